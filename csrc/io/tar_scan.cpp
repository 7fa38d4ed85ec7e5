// One pass over a tar archive's headers: name, data offset and size of every regular file. Reads with pread()
// 512 bytes at a time and seeks over member data, so a multi-GB shard costs one header read per member.
//
// Hostile input is refused, never trusted: every numeric field must be well-formed octal (or non-negative GNU
// base-256 that fits int64), every member must end inside the file, pax records must have sane lengths, and
// name records are capped. What the strict mode of fastio/format/tar/index.py refuses (a zero block followed by
// more data, no end-of-archive marker) is not an error here: it is reported in TarScan::problem, so one scan
// serves both modes. The Python twin is fastio.format.tar.scan._scan_tar_reference; keep the two in step.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "io/gather.h"

namespace fastio {

namespace {

constexpr int64_t kBlock = 512;
constexpr int64_t kMaxNameRecord = int64_t{1} << 20;  // a GNU long name or a pax header bigger is hostile
constexpr int64_t kMaxPaxHeader = int64_t{1} << 24;
constexpr int64_t kTailChunk = int64_t{1} << 16;

struct Fd {
  int fd;
  explicit Fd(const std::string& path) : fd(::open(path.c_str(), O_RDONLY)) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string at(int64_t pos) { return " at byte " + std::to_string(pos); }

std::string printable(const char* field, size_t width) {
  std::string out;
  for (size_t i = 0; i < width; ++i) {
    const auto c = static_cast<unsigned char>(field[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

// A numeric header field: octal digits (leading spaces allowed) ended by NUL or space, or GNU base-256.
int64_t parse_number(const char* field, size_t width, const char* what, int64_t header_pos) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(field);
  if (bytes[0] & 0x80) {
    if (bytes[0] & 0x40) {
      throw std::runtime_error(std::string(what) + " field is a negative base-256 number" + at(header_pos));
    }
    int64_t value = bytes[0] & 0x3f;
    for (size_t i = 1; i < width; ++i) {
      if (value > (std::numeric_limits<int64_t>::max() >> 8)) {
        throw std::runtime_error(std::string(what) + " field (base-256) overflows int64" + at(header_pos));
      }
      value = (value << 8) | bytes[i];
    }
    return value;
  }
  size_t i = 0;
  while (i < width && field[i] == ' ') ++i;
  int64_t value = 0;
  for (; i < width && field[i] >= '0' && field[i] <= '7'; ++i) {
    if (value > (std::numeric_limits<int64_t>::max() >> 3)) {
      throw std::runtime_error(std::string(what) + " field (octal) overflows int64" + at(header_pos));
    }
    value = value * 8 + (field[i] - '0');
  }
  for (; i < width; ++i) {
    if (field[i] != '\0' && field[i] != ' ') {
      throw std::runtime_error(std::string(what) + " field holds non-octal bytes '" + printable(field, width) +
                               "'" + at(header_pos));
    }
  }
  return value;
}

std::string field_string(const char* field, size_t width) { return std::string(field, strnlen(field, width)); }

// The sum of the header's bytes, the checksum field counted as spaces; as unsigned bytes (POSIX) or, as some
// old tars wrote it, signed ones (Python's tarfile accepts both too).
bool checksum_ok(const unsigned char* header, int64_t pos) {
  const int64_t stored = parse_number(reinterpret_cast<const char*>(header) + 148, 8, "checksum", pos);
  int64_t sum = 0, signed_sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    const unsigned char c = (i >= 148 && i < 156) ? ' ' : header[i];
    sum += c;
    signed_sum += static_cast<signed char>(c);
  }
  return stored == sum || stored == signed_sum;
}

bool all_zero(const char* data, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (data[i] != 0) return false;
  }
  return true;
}

int64_t parse_decimal(const std::string& text, const char* what, int64_t header_pos) {
  if (text.empty()) throw std::runtime_error(std::string("pax ") + what + " is empty" + at(header_pos));
  int64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9' || value > (std::numeric_limits<int64_t>::max() - 9) / 10) {
      throw std::runtime_error(std::string("pax ") + what + " '" + printable(text.data(), text.size()) +
                               "' is not a non-negative int64" + at(header_pos));
    }
    value = value * 10 + (c - '0');
  }
  return value;
}

struct PaxOverrides {
  std::string path;
  int64_t size = -1;
};

// The records of a pax extended header: "<len> <key>=<value>\n", <len> counting the whole record.
PaxOverrides pax_records(const std::string& data, int64_t header_pos) {
  PaxOverrides found;
  size_t pos = 0;
  while (pos < data.size()) {
    if (data[pos] == '\0' && all_zero(data.data() + pos, data.size() - pos)) break;  // NUL padding
    const size_t space = data.find(' ', pos);
    const size_t digits = space == std::string::npos ? 0 : space - pos;
    int64_t len = 0;
    bool ok = digits > 0 && digits <= 18;
    for (size_t i = pos; ok && i < space; ++i) {
      ok = data[i] >= '0' && data[i] <= '9';
      len = len * 10 + (data[i] - '0');
    }
    // The shortest record is "<len> k=\n": the length digits, a space, a key, '=' and the newline.
    if (!ok || len < static_cast<int64_t>(digits) + 4 || pos + static_cast<size_t>(len) > data.size() ||
        data[pos + len - 1] != '\n') {
      throw std::runtime_error("pax header record at offset " + std::to_string(pos) + " has a bad length" +
                               at(header_pos));
    }
    const std::string record = data.substr(space + 1, pos + len - space - 2);
    const size_t eq = record.find('=');
    if (eq == std::string::npos) {
      throw std::runtime_error("pax header record at offset " + std::to_string(pos) + " has no '='" +
                               at(header_pos));
    }
    const std::string key = record.substr(0, eq);
    if (key == "path") found.path = record.substr(eq + 1);
    if (key == "size") found.size = parse_decimal(record.substr(eq + 1), "size", header_pos);
    pos += len;
  }
  return found;
}

void read_exact(int fd, int64_t offset, int64_t size, char* out) {
  int64_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, out + done, size - done, offset + done);
    if (n <= 0) throw std::runtime_error("short read" + at(offset + done));
    done += n;
  }
}

std::string read_string(int fd, int64_t offset, int64_t size) {
  std::string data(static_cast<size_t>(size), '\0');
  read_exact(fd, offset, size, &data[0]);
  return data;
}

// Where the first non-zero byte after `from` lies (file_size when there is none).
int64_t first_nonzero(int fd, int64_t from, int64_t file_size) {
  std::string chunk;
  for (int64_t pos = from; pos < file_size; pos += kTailChunk) {
    const int64_t n = std::min(kTailChunk, file_size - pos);
    chunk.resize(static_cast<size_t>(n));
    read_exact(fd, pos, n, &chunk[0]);
    for (int64_t i = 0; i < n; ++i) {
      if (chunk[i] != 0) return pos + i;
    }
  }
  return file_size;
}

}  // namespace

TarScan scan_tar(const std::string& path) {
  Fd file(path);
  if (file.fd < 0) throw std::runtime_error("cannot open: " + std::string(std::strerror(errno)));
  struct stat st {};
  if (::fstat(file.fd, &st) != 0) throw std::runtime_error("cannot stat: " + std::string(std::strerror(errno)));
  const int64_t file_size = st.st_size;

  TarScan scan;
  PaxOverrides pax;
  std::string long_name;
  int64_t pos = 0;
  char h[kBlock];
  while (true) {
    if (pos >= file_size) {
      scan.problem = "no end-of-archive marker: file ends at " + std::to_string(file_size) + " after " +
                     std::to_string(scan.members.size()) + " members";
      break;
    }
    if (pos + kBlock > file_size) {
      throw std::runtime_error("truncated: a partial header" + at(pos) + ", the file ends at " +
                               std::to_string(file_size));
    }
    read_exact(file.fd, pos, kBlock, h);
    if (all_zero(h, kBlock)) {  // the end-of-archive marker: only zeros may follow (GNU pads to a record)
      const int64_t next = first_nonzero(file.fd, pos + kBlock, file_size);
      if (next < file_size) {
        const int64_t block = next / kBlock * kBlock;
        char after[kBlock] = {0};
        const int64_t n = std::min(kBlock, file_size - block);
        read_exact(file.fd, block, n, after);
        bool header = false;
        try {
          header = n == kBlock && checksum_ok(reinterpret_cast<const unsigned char*>(after), block);
        } catch (const std::runtime_error&) {
        }
        scan.problem = "zero block" + at(pos) + " followed by " +
                       (header ? "a member header" : "non-zero data (a damaged header?)") + at(block);
      }
      break;
    }
    const auto* header = reinterpret_cast<const unsigned char*>(h);
    if (!checksum_ok(header, pos)) throw std::runtime_error("bad tar header checksum" + at(pos));
    int64_t size = parse_number(h + 124, 12, "size", pos);
    const char type = h[156];
    if (type != 'x' && type != 'g' && pax.size >= 0) size = pax.size;
    const int64_t data_offset = pos + kBlock;
    if (size > file_size - data_offset) {
      throw std::runtime_error("member" + at(pos) + " claims " + std::to_string(size) +
                               " bytes but the file ends at " + std::to_string(file_size));
    }
    if (type == 'L') {
      if (size > kMaxNameRecord) {
        throw std::runtime_error("GNU long name of " + std::to_string(size) + " bytes" + at(pos));
      }
      long_name = read_string(file.fd, data_offset, size);
      long_name.resize(strnlen(long_name.c_str(), long_name.size()));
    } else if (type == 'x') {
      if (size > kMaxPaxHeader) {
        throw std::runtime_error("pax header of " + std::to_string(size) + " bytes" + at(pos));
      }
      pax = pax_records(read_string(file.fd, data_offset, size), pos);
      if (!pax.path.empty()) long_name = pax.path;
    } else if (type == '0' || type == '\0' || type == '7') {
      std::string name = long_name;
      if (name.empty()) {
        name = field_string(h, 100);
        const std::string prefix = field_string(h + 345, 155);
        if (std::memcmp(h + 257, "ustar", 5) == 0 && !prefix.empty()) name = prefix + "/" + name;
      }
      scan.members.push_back({name, data_offset, size});
      long_name.clear();
      pax = PaxOverrides();
    } else if (type != 'g') {
      long_name.clear();  // directories, links and others carry no sample data
      pax = PaxOverrides();
    }
    pos = data_offset + (size + kBlock - 1) / kBlock * kBlock;
  }
  return scan;
}

}  // namespace fastio
