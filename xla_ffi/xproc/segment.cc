#include "xla_ffi/xproc/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace flexlink::xproc {
namespace {

constexpr char kPrefix[] = "/flexlink-";
constexpr size_t kRandomBytes = 16;  // 128 bits: names cannot be guessed or enumerated

std::string SysError(const std::string& what, int err) {
  return "flexlink: cross-process segment: " + what + ": " + std::strerror(err);
}

Status RandomName(std::string* name) {
  unsigned char bytes[kRandomBytes];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t r = getrandom(bytes + got, sizeof bytes - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Status::Internal(SysError("getrandom", errno));
    }
    got += static_cast<size_t>(r);
  }
  static const char hex[] = "0123456789abcdef";
  *name = kPrefix;
  for (unsigned char b : bytes) {
    *name += hex[b >> 4];
    *name += hex[b & 15];
  }
  return Status::Ok();
}

Status Map(int fd, size_t bytes, const std::string& name, char** out) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Status::Internal(SysError("mmap " + name, errno));
  *out = static_cast<char*>(p);
  return Status::Ok();
}

}  // namespace

bool Segment::ValidName(const std::string& name) {
  const size_t prefix = sizeof kPrefix - 1;
  if (name.size() != prefix + 2 * kRandomBytes || name.compare(0, prefix, kPrefix) != 0) return false;
  for (size_t i = prefix; i < name.size(); ++i)
    if (!((name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f'))) return false;
  return true;
}

Status Segment::Create(size_t bytes, std::unique_ptr<Segment>* out) {
  std::string name;
  int fd = -1;
  // A collision of 128 random bits does not happen; EEXIST is retried anyway rather than reported.
  for (int attempt = 0; fd < 0; ++attempt) {
    FLEXLINK_RETURN_IF_ERROR(RandomName(&name));
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && (errno != EEXIST || attempt == 3)) return Status::Internal(SysError("shm_open " + name, errno));
  }
  auto fail = [&](const std::string& what) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return Status::Internal(SysError(what + " " + name, err));
  };
  // The mode given to shm_open is masked by the umask; fchmod is not, and a umask could only make
  // the file more private, but an explicit 0600 documents (and guarantees) what attach checks.
  if (fchmod(fd, 0600) != 0) return fail("fchmod");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) return fail("ftruncate");
  char* data = nullptr;
  Status s = Map(fd, bytes, name, &data);
  close(fd);
  if (!s.ok()) {
    shm_unlink(name.c_str());
    return s;
  }
  out->reset(new Segment(name, data, bytes));
  return Status::Ok();
}

Status Segment::Attach(const std::string& name, std::unique_ptr<Segment>* out) {
  if (!ValidName(name))
    return Status::InvalidArgument("flexlink: cross-process segment: '" + name +
                                   "' is not a FlexLink segment name (/flexlink- and 32 hex digits)");
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return Status::Internal(SysError("shm_open " + name, errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return Status::Internal(SysError("fstat " + name, err));
  }
  if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    close(fd);
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status::FailedPrecondition(
        "flexlink: cross-process segment " + name + " is refused: owner uid " + std::to_string(st.st_uid) +
        ", mode " + mode + " (it must belong to this user, uid " + std::to_string(geteuid()) +
        ", with mode 0600: another user could read or write it)");
  }
  char* data = nullptr;
  Status s = st.st_size > 0 ? Map(fd, static_cast<size_t>(st.st_size), name, &data)
                            : Status::FailedPrecondition("flexlink: cross-process segment " + name + " is empty");
  close(fd);
  FLEXLINK_RETURN_IF_ERROR(s);
  out->reset(new Segment(name, data, static_cast<size_t>(st.st_size)));
  return Status::Ok();
}

Status Segment::Unlink(const std::string& name) {
  if (!ValidName(name))
    return Status::InvalidArgument("flexlink: cross-process segment: '" + name +
                                   "' is not a FlexLink segment name (/flexlink- and 32 hex digits)");
  if (shm_unlink(name.c_str()) != 0) return Status::Internal(SysError("shm_unlink " + name, errno));
  return Status::Ok();
}

Segment::~Segment() { munmap(data_, size_); }

}  // namespace flexlink::xproc
