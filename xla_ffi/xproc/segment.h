// A POSIX shared-memory segment private to this user, for ranks of one group that live in several
// processes of one host. Names are unguessable (128 random bits), the file is 0600 whatever the
// umask, and attaching refuses a segment of another user or one readable by others, so nothing
// outside the job can read or inject data (DESIGN.md, "Nothing outside the job gets in").
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "xla_ffi/core/status.h"

namespace flexlink::xproc {

class Segment {
 public:
  // Creates a new segment of `bytes` (zero-filled) named "/flexlink-<32 hex>" and maps it.
  static Status Create(size_t bytes, std::unique_ptr<Segment>* out);
  // Maps an existing segment after checking its owner (our effective uid) and mode (no group or
  // other bits). The caller checks the contents (process_group.cc).
  static Status Attach(const std::string& name, std::unique_ptr<Segment>* out);
  // shm_unlink: the name goes, mappings stay valid until unmapped.
  static Status Unlink(const std::string& name);
  // Whether `name` has the form Create gives (also keeps callers from naming arbitrary files).
  static bool ValidName(const std::string& name);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  Segment(std::string name, char* data, size_t size) : name_(std::move(name)), data_(data), size_(size) {}
  std::string name_;
  char* data_;
  size_t size_;
};

}  // namespace flexlink::xproc
