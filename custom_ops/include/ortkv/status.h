// Status values below the framework: kernels, codecs and the VMM return these; the ORT adapter turns
// them into OrtStatus, the bindings into Python exceptions. Nothing throws across a C boundary.
#pragma once
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace ortkv {

// Each code has a stable tag that the message starts with ("[ortkv:E_CAPACITY] ..."), so that the
// Python layer can raise the matching typed error (CapacityError, AliasError, ...) from ORT's text.
enum class Code {
  kOk = 0,
  kInvalidArgument,  // E_INPUT: shape, type, rank, attribute or position < 0
  kCapacity,         // E_CAPACITY: position + n > capacity
  kAlias,            // E_ALIAS: updated_cache is not the storage of cache
  kReadOnly,         // E_READONLY: the write would land in a read-only range
  kUncommitted,      // E_UNCOMMITTED: the write would land in reserved memory not committed yet
  kRuntime,          // E_RUNTIME: a driver or launch failure
};

// A tensor's dims as error messages write them: "[2, 3, 64]".
inline std::string ShapeText(const std::vector<int64_t>& d) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < d.size(); ++i) s << (i ? ", " : "") << d[i];
  s << "]";
  return s.str();
}

// Note [Messages on the error path only]
// The plans that check a run's inputs run on every call of every node (a float32 decode step: ~60 plans). An
// std::ostringstream costs ~1 us to construct (its locale), so they build their messages with Message, whose
// stream is made by the first <<: a check that passes constructs nothing. str() of an unused Message is "".
class Message {
 public:
  template <typename T>
  Message& operator<<(const T& v) {
    if (!s_) s_.emplace();
    *s_ << v;
    return *this;
  }
  std::string str() const { return s_ ? s_->str() : std::string(); }

 private:
  std::optional<std::ostringstream> s_;
};

// "<op> node '<node>'" as a message prefix, formatted only when streamed into a Message that is being built
// (Note [Messages on the error path only]): a plan keeps one per run without allocating.
struct NodeWhere {
  const char* op;
  const std::string& node;
};
inline std::ostream& operator<<(std::ostream& os, const NodeWhere& w) { return os << w.op << " node '" << w.node << "'"; }

inline const char* CodeTag(Code c) {
  switch (c) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "E_INPUT";
    case Code::kCapacity: return "E_CAPACITY";
    case Code::kAlias: return "E_ALIAS";
    case Code::kReadOnly: return "E_READONLY";
    case Code::kUncommitted: return "E_UNCOMMITTED";
    case Code::kRuntime: return "E_RUNTIME";
  }
  return "E_UNKNOWN";
}

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "[ortkv:E_CAPACITY] <message>"
  std::string Tagged() const { return std::string("[ortkv:") + CodeTag(code_) + "] " + message_; }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

#define ORTKV_RETURN_IF_ERR(expr)       \
  do {                                  \
    ::ortkv::Status _st = (expr);       \
    if (!_st.ok()) return _st;          \
  } while (0)

}  // namespace ortkv
