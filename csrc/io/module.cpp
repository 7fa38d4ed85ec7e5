// Python bindings of fastio._C. Index arrays arrive as C-contiguous numpy arrays of the exact dtype (pybind11
// checks, without converting), the output as any writable contiguous buffer; the GIL is released while copying.
// The gathers return -1, or the first sample whose read faulted (SIGBUS: the file shrank under its mapping).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "io/gather.h"

namespace py = pybind11;

namespace {

using I64 = py::array_t<int64_t, py::array::c_style>;
using I32 = py::array_t<int32_t, py::array::c_style>;

uint8_t* writable(py::buffer out, int64_t* nbytes) {
  py::buffer_info info = out.request(true);
  if (info.readonly) throw std::invalid_argument("fastio gather: output buffer is read-only");
  *nbytes = info.size * info.itemsize;
  return static_cast<uint8_t*>(info.ptr);
}

void check_batch(const char* what, int64_t expected, int64_t actual) {
  if (expected != actual) {
    throw std::invalid_argument(std::string("fastio gather: ") + what + " has " + std::to_string(actual) +
                                " entries, expected " + std::to_string(expected));
  }
}

int64_t gather_rows(I64 bases, I64 limits, I32 shard_ids, I64 offsets, int64_t row_nbytes, py::buffer out,
                 int num_threads) {
  check_batch("limits", bases.size(), limits.size());
  check_batch("offsets", shard_ids.size(), offsets.size());
  int64_t out_nbytes = 0;
  uint8_t* dst = writable(out, &out_nbytes);
  py::gil_scoped_release release;
  return fastio::gather_rows(bases.data(), limits.data(), bases.size(), shard_ids.data(), offsets.data(), shard_ids.size(),
                      row_nbytes, dst, out_nbytes, num_threads);
}

int64_t gather_ranges(I64 bases, I64 limits, I32 shard_ids, I64 offsets, I64 lengths, I64 dst_offsets, py::buffer out,
                   int num_threads) {
  check_batch("limits", bases.size(), limits.size());
  check_batch("offsets", shard_ids.size(), offsets.size());
  check_batch("lengths", shard_ids.size(), lengths.size());
  check_batch("dst_offsets", shard_ids.size(), dst_offsets.size());
  int64_t out_nbytes = 0;
  uint8_t* dst = writable(out, &out_nbytes);
  py::gil_scoped_release release;
  return fastio::gather_ranges(bases.data(), limits.data(), bases.size(), shard_ids.data(), offsets.data(), lengths.data(),
                        dst_offsets.data(), shard_ids.size(), dst, out_nbytes, num_threads);
}

py::tuple scan_tar(const std::string& path) {
  fastio::TarScan scan;
  {
    py::gil_scoped_release release;
    scan = fastio::scan_tar(path);
  }
  const std::vector<fastio::TarMember>& members = scan.members;
  py::list names;
  I64 offsets(static_cast<py::ssize_t>(members.size()));
  I64 sizes(static_cast<py::ssize_t>(members.size()));
  auto off = offsets.mutable_unchecked<1>();
  auto siz = sizes.mutable_unchecked<1>();
  for (size_t i = 0; i < members.size(); ++i) {
    names.append(py::bytes(members[i].name));
    off(i) = members[i].offset;
    siz(i) = members[i].size;
  }
  return py::make_tuple(names, offsets, sizes, py::str(scan.problem));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastio native kernels: batch gather from mmap'd shards, tar header scan";
  m.def("gather_rows", &gather_rows, py::arg("bases"), py::arg("limits"), py::arg("shard_ids"), py::arg("offsets"),
        py::arg("row_nbytes"), py::arg("out"), py::arg("num_threads"));
  m.def("gather_ranges", &gather_ranges, py::arg("bases"), py::arg("limits"), py::arg("shard_ids"),
        py::arg("offsets"), py::arg("lengths"), py::arg("dst_offsets"), py::arg("out"), py::arg("num_threads"));
  m.def("scan_tar", &scan_tar, py::arg("path"));
}
