// The convert_kernels extension's Python interface.

#include "convert_kernels.h"

using namespace i4p;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("unpack_gptq", &unpack_gptq, "GPTQ qweight [K/8, N] -> codes uint8 [N, K]", nogil);
  m.def("unpack_awq", &unpack_awq, "AWQ GEMM qweight [K, N/8] -> codes uint8 [N, K]", nogil);
  m.def("unpack_ct", &unpack_ct, "compressed-tensors weight_packed [N, K/8] -> codes uint8 [N, K]", nogil);
  m.def("lossless", &lossless, "codes -> (q int8, sum q^2 per group, max q^2 per group)", nogil);
  m.def("lossless_job", &lossless_job, "one lossless job: checks, q, cast scales, error (see w4a8.lossless_fast)",
        nogil);
  m.def("requant", &requant, "scale-search requantisation (see w4a8.requantize)", nogil);
  m.def("requant_job", &requant_job, "one requant job of an asymmetric source (see w4a8.requant_fast)", nogil);
  m.def(
      "search_batches", &search_batches,
      "histogram batches searched so far in float32 and in float64 (the close calls, or all when forced)");
  m.def(
      "use_awq_avx2", &use_awq_avx2,
      "tests: the AVX2 AWQ unpack on (where the CPU has it) or off; returns the previous setting");
  m.def(
      "force_search64", &force_search64,
      "tests: search every batch in float64 from the next call on; returns the previous setting");
  // a contiguous 1-D buffer's bytes
  auto span = [](const py::buffer_info& info, const char* what) {
    TORCH_CHECK(info.ndim <= 1 && (info.ndim == 0 || info.strides[0] == info.itemsize), what,
                ": expected a contiguous 1-D buffer");
    return info.size * info.itemsize;
  };
  m.def(
      "crc32c",
      [span](py::buffer b, int64_t crc) {
        py::buffer_info info = b.request();
        const int64_t n = span(info, "crc32c");
        const auto* p = static_cast<const uint8_t*>(info.ptr);
        py::gil_scoped_release release;
        return static_cast<int64_t>(crc32c_extend(static_cast<uint32_t>(crc), p, n));
      },
      "CRC-32C of a contiguous buffer, continuing from crc (0 to start)", py::arg("data"), py::arg("crc") = 0);
  m.def(
      "crc32c_copy",
      [span](py::buffer src, py::buffer dst, int64_t crc) {
        py::buffer_info si = src.request(), di = dst.request(true);
        const int64_t n = span(si, "crc32c_copy src"), room = span(di, "crc32c_copy dst");
        TORCH_CHECK(room >= n, "crc32c_copy: ", n, " bytes into a buffer of ", room);
        const auto* sp = static_cast<const uint8_t*>(si.ptr);
        auto* dp = static_cast<uint8_t*>(di.ptr);
        py::gil_scoped_release release;
        // in steps that stay in cache between the copy and the CRC: one pass over the source
        constexpr int64_t kStep = 3 * kCrcBlock * 4;
        uint32_t c = static_cast<uint32_t>(crc);
        for (int64_t i = 0; i < n; i += kStep) {
          const int64_t m = std::min(kStep, n - i);
          std::memcpy(dp + i, sp + i, m);
          c = crc32c_extend(c, dp + i, m);
        }
        return static_cast<int64_t>(c);
      },
      "copy src into dst and return the CRC-32C of the copied bytes, continuing from crc (0 to start)",
      py::arg("src"), py::arg("dst"), py::arg("crc") = 0);
}
