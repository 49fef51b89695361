// make_seeds.cpp — writes the seed corpora of the fuzz targets, corpus/<reader>/<name>, from
// towers' own writers where it has them (write_safetensors, save_checkpoint) and from the
// formats' definitions otherwise: small valid files, and a few truncated or corrupt ones. The
// output is deterministic, so running it again changes nothing that is committed.
//   fuzz_make_seeds <corpus dir>     (scripts/fuzz.sh seeds)
#include <unistd.h>  // getpid
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/check.h"
#include "data/cifar10.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"

namespace {

namespace fs = std::filesystem;
using Bytes = std::string;

void put(const fs::path& dir, const std::string& name, const Bytes& bytes) {
  fs::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TOWERS_CHECK(out.good(), "cannot write '{}'", (dir / name).string());
}

Bytes slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// gzip framing (windowBits 15 + 16), as gzip(1) and gzwrite write it; mtime 0, so stable.
Bytes gzip(const Bytes& raw) {
  z_stream z{};
  TOWERS_CHECK(deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK,
               "deflateInit2");
  Bytes out(deflateBound(&z, raw.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw.data()));
  z.avail_in = static_cast<uInt>(raw.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  TOWERS_CHECK(deflate(&z, Z_FINISH) == Z_STREAM_END, "deflate");
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

Bytes idx(uint32_t magic, const std::vector<uint32_t>& dims, const Bytes& payload) {
  Bytes b;
  auto be = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<char>(v >> s));
  };
  be(magic);
  for (uint32_t d : dims) be(d);
  return b + payload;
}

// The idx target's input: 2-byte little-endian length of the image file, then both files.
Bytes two_files(const Bytes& images, const Bytes& labels) {
  Bytes b;
  b.push_back(static_cast<char>(images.size() & 0xff));
  b.push_back(static_cast<char>(images.size() >> 8));
  return b + images + labels;
}

void idx_seeds(const fs::path& dir) {
  Bytes pixels, labels = {3, 0, 9, 1, 3};
  for (int i = 0; i < 5 * 3 * 4; ++i) pixels.push_back(static_cast<char>(i * 37 % 256));
  const Bytes images_file = idx(0x803, {5, 3, 4}, pixels);
  const Bytes labels_file = idx(0x801, {5}, labels);
  put(dir, "plain", two_files(images_file, labels_file));
  put(dir, "gzip", two_files(gzip(images_file), gzip(labels_file)));
  put(dir, "gzip-images-plain-labels", two_files(gzip(images_file), labels_file));
  put(dir, "truncated-payload",
      two_files(images_file.substr(0, images_file.size() - 7), labels_file));
  put(dir, "truncated-gzip-stream",
      two_files(gzip(images_file), gzip(labels_file).substr(0, gzip(labels_file).size() - 9)));
  put(dir, "trailing-garbage", two_files(images_file, labels_file + "\x01"));
  put(dir, "label-out-of-range", two_files(images_file, idx(0x801, {5}, {3, 0, 10, 1, 3})));
  put(dir, "count-mismatch", two_files(images_file, idx(0x801, {4}, {3, 0, 9, 1})));
  put(dir, "wrong-magic", two_files(idx(0xD03, {5, 3, 4}, pixels), labels_file));
  // The gzip magic, then a compression method that is not deflate.
  put(dir, "gzip-unknown-method", two_files(Bytes("\x1f\x8b\x00\x80", 4), labels_file));
  // Headers that claim far more than the file holds.
  put(dir, "claims-784-mb", two_files(idx(0x803, {1000000, 28, 28}, pixels), labels_file));
  put(dir, "claims-4-gb-labels", two_files(images_file, idx(0x801, {0xffffffffu}, labels)));
}

Bytes cifar_records(const Bytes& labels) {
  Bytes b;
  for (size_t r = 0; r < labels.size(); ++r) {
    b.push_back(labels[r]);
    for (int i = 0; i < 3072; ++i) b.push_back(static_cast<char>((i + 31 * r) % 251));
  }
  return b;
}

// The cifar10 target's input: a byte for the file count (value mod 3, plus 1), then the files.
void cifar10_seeds(const fs::path& dir) {
  put(dir, "one-file-one-record", Bytes(1, '\0') + cifar_records({7}));
  put(dir, "two-files-one-record-each", Bytes(1, '\1') + cifar_records({2, 9}));
  put(dir, "bad-label", Bytes(1, '\0') + cifar_records({10}));
  put(dir, "truncated", Bytes(1, '\0') + cifar_records({4}).substr(0, 3000));
}

// A safetensors file made by hand: the header text, then `data` bytes.
Bytes raw_safetensors(const std::string& header, const Bytes& data) {
  const uint64_t n = header.size();
  return Bytes(reinterpret_cast<const char*>(&n), 8) + header + data;
}

void safetensors_seeds(const fs::path& dir, const fs::path& scratch) {
  const std::vector<float> a = {1, 2, 3, 4, 5, 6}, b = {-7.5f};
  const fs::path file = scratch / "t.safetensors";
  towers::io::write_safetensors(
      file.string(),
      {{"a", {2, 3}, a.data()}, {"scalar", {}, b.data()}, {"empty", {0, 4}, nullptr}},
      {{"k", "v"}, {"x", "{\"json\": 1}"}});
  const Bytes valid = slurp(file);
  put(dir, "three-tensors", valid);
  towers::io::write_safetensors(file.string(), {}, {});
  put(dir, "empty", slurp(file));
  put(dir, "truncated-data", valid.substr(0, valid.size() - 5));
  put(dir, "truncated-header", valid.substr(0, 40));
  put(dir, "overlap",
      raw_safetensors(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                      Bytes(12, '\0')));
  put(dir, "dtype-bf16",
      raw_safetensors(R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})",
                      Bytes(4, '\0')));
  Bytes lying = valid;
  lying[3] = '\x01';  // a header length 16 MiB larger: under the limit, past the end
  put(dir, "header-length-past-end", lying);
}

void checkpoint_seeds(const fs::path& dir, const fs::path& scratch) {
  // The layout of checkpoint_fuzz.cpp.
  const towers::ParameterLayout layout(
      {{"conv1/weight", {1, 1, 3, 3}, {}}, {"conv1/bias", {2}, {}}});
  towers::HostBuffer params(layout.total()), momentum(layout.total());
  for (const towers::Variable& v : layout.variables())
    for (int64_t i = 0; i < v.size; ++i) {
      params[v.offset + i] = 0.25f * static_cast<float>(i) - 1;
      momentum[v.offset + i] = 0.5f * static_cast<float>(i);
    }
  towers::io::CheckpointMeta meta;
  meta.model = "fuzz_small";
  meta.step = 12;
  meta.examples_seen = 12 * 64;
  meta.epoch = 0.75;
  meta.config = {{"batch", 64}, {"mode", "sync"},         {"towers", 2},
                 {"lr", 0.1},   {"dataset", "synthetic"}, {"layers", {1, 2, {{"nested", true}}}}};
  meta.optimizer_state = {{"name", "momentum"}, {"updates", 12}, {"momentum", 0.9}};
  const std::string with_slot = towers::io::save_checkpoint(
      (scratch / "a").string(), meta, layout, params.data(), {{"momentum", momentum.data()}}, 0);
  const Bytes valid = slurp(with_slot);
  put(dir, "with-momentum", valid);
  meta.step = 0;
  meta.config = nlohmann::json::object();
  meta.optimizer_state = {{"name", "sgd"}, {"updates", 0}};
  put(dir, "without-slots",
      slurp(towers::io::save_checkpoint((scratch / "b").string(), meta, layout, params.data(), {},
                                        0)));
  Bytes flipped = valid;
  flipped[flipped.size() - 3] ^= 0x10;
  put(dir, "checksum-mismatch", flipped);
  put(dir, "truncated", valid.substr(0, valid.size() - 17));
}

}  // namespace

// Model files: the built-in models (read from models/ of the source tree, where fuzz.sh runs)
// and a few shapes of JSON a model reader meets.
void json_source_seeds(const fs::path& dir) {
  for (const char* name : {"cifar10", "fashion", "mlp"})
    put(dir, std::string(name) + ".json", slurp(fs::path("models") / (std::string(name) + ".json")));
  put(dir, "escapes.json", R"({"a\u00e9/~": [1, -2.5e3, true, null, "x\n"], "a": {"b": []}})");
  put(dir, "duplicate.json", "{\"k\": 1,\n \"k\": [2]}");
  put(dir, "nested.json", "[[[[[[[[{}]]]]]]]]");
  put(dir, "lines.json", "\n\n  {\n\t\"layers\": [\n    {\"name\": \"x\"}\n  ]\n}\n");
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  const fs::path root = argv[1];
  const fs::path scratch =
      fs::temp_directory_path() / ("towers-seeds-" + std::to_string(::getpid()));
  try {
    fs::create_directories(scratch);
    idx_seeds(root / "idx");
    cifar10_seeds(root / "cifar10");
    safetensors_seeds(root / "safetensors", scratch);
    checkpoint_seeds(root / "checkpoint", scratch);
    json_source_seeds(root / "json_source");
  } catch (const towers::Error& e) {
    std::fprintf(stderr, "fuzz_make_seeds: %s\n", e.what());
    fs::remove_all(scratch);
    return 1;
  }
  fs::remove_all(scratch);
  return 0;
}
