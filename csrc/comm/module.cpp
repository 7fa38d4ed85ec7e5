// fastcomm._C: registers the CPU kernels under the schemas that fastcomm/ops.py declares.
// torch/library.h and pybind11 alone, not <torch/extension.h> (which includes all of torch's C++ API and took
// 24 of the build's ~95 CPU seconds): the module registers kernels and exposes four small functions.
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "comm/cpu_isa.h"
#include "comm/kernels.h"

TORCH_LIBRARY_IMPL(fastcomm, CPU, m) {
  m.impl("topk_select", &fastcomm::topk_select_cpu);
  m.impl("quantize_blockwise", &fastcomm::quantize_blockwise_cpu);
  m.impl("dequantize_blockwise", &fastcomm::dequantize_blockwise_cpu);
  m.impl("dequantize_blockwise_into", &fastcomm::dequantize_blockwise_into_cpu);
  m.impl("sign_compress", &fastcomm::sign_compress_cpu);
  m.impl("sign_decompress", &fastcomm::sign_decompress_cpu);
  m.impl("sign_decompress_into", &fastcomm::sign_decompress_into_cpu);
  m.impl("sparse_accumulate", &fastcomm::sparse_accumulate_cpu);
  m.impl("sparse_mean", &fastcomm::sparse_mean_cpu);
  m.impl("powersgd_project", &fastcomm::powersgd_project_cpu);
  m.impl("powersgd_back_project", &fastcomm::powersgd_back_project_cpu);
  m.impl("powersgd_expand", &fastcomm::powersgd_expand_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastcomm native kernels; the ops are reached through torch.ops.fastcomm";
  m.def("openmp_threads", []() { return at::get_num_threads(); }, "threads the CPU kernels run on");
  m.def("cpu_isa", []() { return fastcomm::use_avx2() ? "avx2" : "baseline"; },
        "which copy of the vectorized CPU loops runs: avx2 or baseline (x86-64 SSE2 or the target's default)");
  m.def("_set_avx2", [](bool allowed) { fastcomm::avx2_allowed().store(allowed); },
        "tests only: False runs the baseline copies of the loops on an AVX2 machine");
  m.def("_set_streaming", [](bool allowed) { fastcomm::streaming_allowed().store(allowed); },
        "tests only: False makes the kernels (PowerSGD's, top-k's residual) store through the cache (no non-temporal stores)");
}
