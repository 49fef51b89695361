#include "towers/remote/cluster.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/check.h"

namespace towers::remote {

int Task::rank(const Cluster& c) const {
  if (type == "chief") return 0;
  if (type == "worker") return index + static_cast<int>(c.chief.size());
  return -1;
}

std::string Task::name() const { return fmt::format("{}:{}", type, index); }

Task parse_task(const std::string& text, const std::string& flag) {
  const auto colon = text.find(':');
  Task t;
  t.type = text.substr(0, colon);
  TOWERS_REQUIRE(t.type == "chief" || t.type == "worker" || t.type == "ps",
                 "{} '{}': the task type must be chief, worker or ps (as in worker:0)", flag, text);
  if (colon == std::string::npos) {
    TOWERS_REQUIRE(t.type == "chief", "{} '{}': give the index, as in {}:0", flag, text, t.type);
    return t;
  }
  const std::string idx = text.substr(colon + 1);
  TOWERS_REQUIRE(!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos &&
                     idx.size() < 7,
                 "{} '{}': the index after ':' must be a number, as in {}:0", flag, text, t.type);
  t.index = std::stoi(idx);
  return t;
}

namespace {

std::vector<std::string> addresses(const nlohmann::json& cluster, const char* key,
                                   const std::string& origin) {
  std::vector<std::string> out;
  if (!cluster.contains(key)) return out;
  const nlohmann::json& list = cluster[key];
  TOWERS_REQUIRE(list.is_array(), "{}: cluster.{} must be a list of \"host:port\" strings",
                 origin, key);
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& a = list[i];
    TOWERS_REQUIRE(a.is_string(), "{}: cluster.{}[{}] must be a \"host:port\" string, got {}",
                   origin, key, i, a.dump());
    const std::string s = a.get<std::string>();
    const auto colon = s.rfind(':');
    const std::string port = colon == std::string::npos ? "" : s.substr(colon + 1);
    TOWERS_REQUIRE(colon != std::string::npos && colon > 0 && !port.empty() &&
                       port.find_first_not_of("0123456789") == std::string::npos &&
                       port.size() <= 5 && std::stoi(port) > 0 && std::stoi(port) < 65536,
                   "{}: cluster.{}[{}] is '{}', not host:port with a port in 1..65535", origin,
                   key, i, s);
    out.push_back(s);
  }
  return out;
}

}  // namespace

bool cluster_requested(const std::string& file) {
  const char* env = std::getenv("TF_CONFIG");
  return !file.empty() || (env != nullptr && *env != '\0');
}

ClusterTask read_cluster(const std::string& file, const std::string& task_flag) {
  std::string text, origin;
  if (!file.empty()) {
    std::ifstream in(file);
    TOWERS_REQUIRE(in.good(), "--cluster: cannot read '{}'", file);
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
    origin = file;
  } else {
    const char* env = std::getenv("TF_CONFIG");
    TOWERS_REQUIRE(env != nullptr && *env != '\0',
                   "no cluster: give --cluster FILE or set TF_CONFIG");
    text = env;
    origin = "TF_CONFIG";
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    TOWERS_BAD_INPUT("{}: not valid JSON: {}", origin, e.what());
  }
  TOWERS_REQUIRE(j.is_object() && j.contains("cluster") && j["cluster"].is_object(),
                 "{}: no \"cluster\" object (the TF_CONFIG layout: {{\"cluster\": {{\"worker\": "
                 "[...], \"ps\": [...]}}, \"task\": {{...}}}})",
                 origin);
  ClusterTask ct;
  ct.cluster.origin = origin;
  const nlohmann::json& c = j["cluster"];
  for (const auto& [key, value] : c.items())
    TOWERS_REQUIRE(key == "chief" || key == "worker" || key == "ps" || key == "evaluator",
                   "{}: unknown role cluster.{} (known: chief, worker, ps)", origin, key);
  ct.cluster.chief = addresses(c, "chief", origin);
  ct.cluster.worker = addresses(c, "worker", origin);
  ct.cluster.ps = addresses(c, "ps", origin);
  TOWERS_REQUIRE(ct.cluster.chief.size() <= 1, "{}: cluster.chief has {} entries; at most 1",
                 origin, ct.cluster.chief.size());
  TOWERS_REQUIRE(ct.cluster.workers() >= 1, "{}: the cluster has no chief and no worker", origin);
  TOWERS_REQUIRE(!ct.cluster.ps.empty(), "{}: cluster.ps is empty: a remote tower group needs "
                 "at least one parameter-server shard", origin);
  if (j.contains("task")) {
    const nlohmann::json& t = j["task"];
    TOWERS_REQUIRE(t.is_object() && t.contains("type") && t["type"].is_string(),
                   "{}: task must be {{\"type\": \"worker\", \"index\": 0}}", origin);
    const std::string type = t["type"].get<std::string>();
    const int index = t.contains("index") && t["index"].is_number_integer() ? t["index"].get<int>() : 0;
    ct.task = parse_task(type + ":" + std::to_string(index), origin + ": task");
    ct.task_given = true;
  }
  if (!task_flag.empty()) {
    ct.task = parse_task(task_flag, "--task");
    ct.task_given = true;
  }
  if (ct.task_given) {
    const size_t have = ct.task.type == "chief"    ? ct.cluster.chief.size()
                        : ct.task.type == "worker" ? ct.cluster.worker.size()
                                                   : ct.cluster.ps.size();
    TOWERS_REQUIRE(ct.task.index >= 0 && static_cast<size_t>(ct.task.index) < have,
                   "task {}: {} has {} {} entr{}", ct.task.name(), origin, have, ct.task.type,
                   have == 1 ? "y" : "ies");
  }
  return ct;
}

std::string read_token(const std::string& token_file, const char* env_name, bool optional,
                       bool warn) {
  std::string token;
  if (!token_file.empty()) {
    std::ifstream in(token_file);
    TOWERS_REQUIRE(in.good(), "--token-file: cannot read '{}'", token_file);
    std::getline(in, token);
    while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
    TOWERS_REQUIRE(!token.empty(), "--token-file: '{}' is empty; it must hold the run's token "
                   "on its first line", token_file);
  } else if (const char* env = std::getenv(env_name); env != nullptr && *env != '\0') {
    token = env;
  } else if (optional) {
    return "";
  } else {
    TOWERS_BAD_INPUT("no token: every call of a remote tower group carries the run's token; give "
                     "--token-file FILE or set TOWERS_TOKEN (towers launch writes one)");
  }
  const std::string where = token_file.empty() ? std::string(env_name) : token_file;
  for (char ch : token)
    TOWERS_REQUIRE(ch > ' ' && ch < 127,
                   "the token ({}) has a character that is not printable ASCII", where);
  // Warnings, not errors: a run on a machine of one's own may not care.
  if (!warn) return token;
  struct stat st {};
  if (!token_file.empty() && ::stat(token_file.c_str(), &st) == 0 && (st.st_mode & 044) != 0)
    fmt::print(stderr,
               "towers: warning: the token file '{}' can be read by other users of this machine "
               "(mode {:04o}), and whoever reads a token can call the shards with it: chmod 600 "
               "'{}'\n",
               token_file, st.st_mode & 07777, token_file);
  if (token.size() < kShortToken)
    fmt::print(stderr,
               "towers: warning: the token ({}) has {} characters, few enough to guess: give one "
               "of at least {} random characters (towers launch makes 64 hex digits; so does "
               "`openssl rand -hex 32`)\n",
               where, token.size(), kShortToken);
  return token;
}

std::string fresh_token() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[32];
  in.read(reinterpret_cast<char*>(bytes), sizeof bytes);
  TOWERS_REQUIRE(in.gcount() == sizeof bytes, "cannot read /dev/urandom for a token");
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

std::vector<Range> shard_ranges(int64_t total, int shards) {
  TOWERS_CHECK(shards >= 1 && total >= 0, "bad shard count {}", shards);
  constexpr int64_t kAlign = 16;
  const int64_t blocks = (total + kAlign - 1) / kAlign;
  std::vector<Range> out(shards);
  for (int s = 0; s < shards; ++s) {
    out[s].begin = std::min(total, blocks * s / shards * kAlign);
    out[s].end = std::min(total, blocks * (s + 1) / shards * kAlign);
  }
  return out;
}

std::vector<int> free_loopback_ports(int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    TOWERS_REQUIRE(fd >= 0, "cannot open a socket to find a free port: {}", std::strerror(errno));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    TOWERS_REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                       getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0,
                   "cannot find a free port on 127.0.0.1: {}", std::strerror(errno));
    fds.push_back(fd);
    ports.push_back(ntohs(a.sin_port));
  }
  for (int fd : fds) close(fd);
  return ports;
}

uint64_t layout_hash(const ParameterLayout& layout) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  auto mix = [&](const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  auto mix_int = [&](int64_t v) { mix(&v, sizeof v); };
  for (const Variable& v : layout.variables()) {
    mix(v.spec.name.data(), v.spec.name.size());
    mix_int(static_cast<int64_t>(v.spec.shape.size()));
    for (int64_t d : v.spec.shape) mix_int(d);
    mix_int(v.offset);
    mix_int(v.spec.trainable ? 1 : 0);
    mix(&v.spec.state_rate, sizeof v.spec.state_rate);
  }
  mix_int(layout.total());
  return h;
}

}  // namespace towers::remote
