// A tiny status type for the engine. The engine is plain C++ (no XLA, no Python) so the same code runs
// under the FFI handlers, under `engine_run` and in the C++ tests; the FFI layer maps Status to
// ffi::Error and the nanobind module maps it to RuntimeError, both keeping the message verbatim.
#pragma once

#include <string>
#include <utility>

namespace flexlink {

// kUnavailable: a link could not run its range and touched none of the call's buffers (so the range
// can be re-run elsewhere even in place; docs/faults.md).
enum class StatusCode { kOk, kInvalidArgument, kDeadlineExceeded, kFailedPrecondition, kInternal, kUnavailable };

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status DeadlineExceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
  static Status FailedPrecondition(std::string m) {
    return {StatusCode::kFailedPrecondition, std::move(m)};
  }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// `s` with `where` ("flexlink: <label>: all_reduce on group [0, 1]: ") in front of its message,
// unless it is OK or already a FlexLink message ("flexlink: ...", which says where it comes from).
inline Status Located(const Status& s, const std::string& where) {
  if (s.ok() || s.message().rfind("flexlink:", 0) == 0) return s;
  return Status(s.code(), where + s.message());
}

#define FLEXLINK_RETURN_IF_ERROR(expr)            \
  do {                                            \
    ::flexlink::Status flexlink_status_ = (expr); \
    if (!flexlink_status_.ok()) return flexlink_status_; \
  } while (0)

}  // namespace flexlink
