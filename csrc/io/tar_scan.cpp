// One pass over a tar archive's headers: name, data offset and size of every regular file. Reads with pread()
// 512 bytes at a time and seeks over member data, so a multi-GB shard costs one header read per member.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "io/gather.h"

namespace fastio {

namespace {

constexpr int64_t kBlock = 512;

struct Fd {
  int fd;
  explicit Fd(const std::string& path) : fd(::open(path.c_str(), O_RDONLY)) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

int64_t parse_number(const char* field, size_t width) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(field);
  if (bytes[0] & 0x80) {  // GNU base-256 for sizes >= 8 GiB
    int64_t value = bytes[0] & 0x7f;
    for (size_t i = 1; i < width; ++i) value = (value << 8) | bytes[i];
    return value;
  }
  int64_t value = 0;
  for (size_t i = 0; i < width && field[i]; ++i) {
    if (field[i] == ' ') continue;
    if (field[i] < '0' || field[i] > '7') break;
    value = value * 8 + (field[i] - '0');
  }
  return value;
}

std::string field_string(const char* field, size_t width) { return std::string(field, strnlen(field, width)); }

bool checksum_ok(const unsigned char* header) {
  int64_t stored = parse_number(reinterpret_cast<const char*>(header) + 148, 8);
  int64_t sum = 0;
  for (int i = 0; i < kBlock; ++i) sum += (i >= 148 && i < 156) ? ' ' : header[i];
  return sum == stored;
}

// The "path" record of a pax extended header ("<len> path=<value>\n" records).
std::string pax_path(const std::string& data) {
  size_t pos = 0;
  std::string path;
  while (pos < data.size()) {
    size_t space = data.find(' ', pos);
    if (space == std::string::npos) break;
    int64_t len = std::atoll(data.c_str() + pos);
    if (len <= 0 || pos + static_cast<size_t>(len) > data.size()) break;
    std::string record = data.substr(space + 1, pos + len - space - 2);  // drop the trailing newline
    if (record.rfind("path=", 0) == 0) path = record.substr(5);
    pos += len;
  }
  return path;
}

std::string read_exact(int fd, int64_t offset, int64_t size, const std::string& path) {
  std::string data(static_cast<size_t>(size), '\0');
  int64_t done = 0;
  while (done < size) {
    ssize_t n = ::pread(fd, &data[done], size - done, offset + done);
    if (n <= 0) throw std::runtime_error(path + ": short read at byte " + std::to_string(offset + done));
    done += n;
  }
  return data;
}

}  // namespace

std::vector<TarMember> scan_tar(const std::string& path) {
  Fd file(path);
  if (file.fd < 0) throw std::runtime_error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(file.fd, &st) != 0) throw std::runtime_error(path + ": cannot stat");
  const int64_t file_size = st.st_size;

  std::vector<TarMember> members;
  std::string long_name;
  int64_t pos = 0;
  unsigned char header[kBlock];
  while (pos < file_size) {
    if (pos + kBlock > file_size) {
      throw std::runtime_error(path + ": truncated: a partial header at byte " + std::to_string(pos) +
                               ", the file ends at " + std::to_string(file_size));
    }
    std::string raw = read_exact(file.fd, pos, kBlock, path);
    std::memcpy(header, raw.data(), kBlock);
    if (header[0] == 0) break;  // end-of-archive marker
    if (!checksum_ok(header)) {
      throw std::runtime_error(path + ": bad tar header checksum at byte " + std::to_string(pos));
    }
    const char* h = reinterpret_cast<const char*>(header);
    const int64_t size = parse_number(h + 124, 12);
    const char type = h[156];
    const int64_t data_offset = pos + kBlock;
    if (data_offset + size > file_size) {
      throw std::runtime_error(path + ": member at byte " + std::to_string(pos) + " claims " + std::to_string(size) +
                               " bytes but the file ends at " + std::to_string(file_size));
    }
    if (type == 'L') {
      long_name = read_exact(file.fd, data_offset, size, path);
      long_name.resize(strnlen(long_name.c_str(), long_name.size()));
    } else if (type == 'x') {
      long_name = pax_path(read_exact(file.fd, data_offset, size, path));
    } else if (type == '0' || type == '\0' || type == '7') {
      std::string name = long_name;
      if (name.empty()) {
        name = field_string(h, 100);
        const std::string prefix = field_string(h + 345, 155);
        if (std::memcmp(h + 257, "ustar", 5) == 0 && !prefix.empty()) name = prefix + "/" + name;
      }
      members.push_back({name, data_offset, size});
      long_name.clear();
    } else if (type != 'g') {
      long_name.clear();  // directories, links and others carry no sample data
    }
    pos = data_offset + (size + kBlock - 1) / kBlock * kBlock;
  }
  return members;
}

}  // namespace fastio
