#include "data/dataset.h"

#include "core/check.h"

namespace towers::data {

const uint8_t* Dataset::image(int64_t i) const {
  TOWERS_CHECK(i >= 0 && i < size(), "dataset '{}': example {} out of range [0, {})", name, i,
               size());
  return images.data() + i * example_bytes();
}

void Dataset::validate() const {
  TOWERS_REQUIRE(channels > 0 && height > 0 && width > 0, "dataset '{}': bad image shape {}x{}x{}",
                 name, channels, height, width);
  TOWERS_REQUIRE(num_classes > 0, "dataset '{}': needs at least one class", name);
  TOWERS_REQUIRE(size() > 0, "dataset '{}' holds no examples", name);
  TOWERS_REQUIRE(static_cast<int64_t>(images.size()) == size() * example_bytes(),
                 "dataset '{}': {} image bytes for {} examples of {} bytes", name, images.size(),
                 size(), example_bytes());
  for (int64_t i = 0; i < size(); ++i)
    TOWERS_REQUIRE(labels[i] >= 0 && labels[i] < num_classes,
                   "dataset '{}': label {} of example {} is outside [0, {})", name, labels[i], i,
                   num_classes);
}

}  // namespace towers::data
