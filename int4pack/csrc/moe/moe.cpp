// CPU W4A8 MoE forward, the algorithm of vLLM's dynamic_4bit_int_moe_cpu (docs/kleidiai.md §3.1),
// written from that description. Each expert's two matmuls go through torch's
// _dyn_quant_matmul_4bit, so the same op runs KleidiAI on Arm and torch's reference kernel on x86
// (it picks the path from the packed tensor's size).
//
//   counting sort of (token, slot) pairs by expert, ascending token order inside an expert
//   -> per expert (at::parallel_for, grain 1): y13 = x_e @ w13_e ([2I, H], gate rows then up rows)
//      -> act(gate, up) -> y = act @ w2_e ([H, I])
//   -> gate weight on the output rows (or on the inputs) -> index_add into out [T, H].

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace {

// torch takes fp32 activations for every block size, bf16 only channelwise.
at::ScalarType compute_dtype(at::ScalarType in, bool channelwise) {
  if (in == at::kFloat) return at::kFloat;
  if (in == at::kBFloat16 && channelwise) return at::kBFloat16;
  return at::kFloat;
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& w, int64_t block, int64_t in, int64_t out) {
  // the op reads data_ptr raw: a non-contiguous input gives silently wrong results
  return at::_dyn_quant_matmul_4bit(a.contiguous(), w, block, in, out);
}

at::Tensor activate(const at::Tensor& y13, int64_t inter, int64_t kind) {
  auto g = y13.narrow(1, 0, inter);
  auto u = y13.narrow(1, inter, inter);
  if (kind == 1) {  // gpt-oss SwiGLU: alpha 1.702, limit 7, (up + 1)
    auto gc = at::clamp_max(g, 7.0);
    auto uc = at::clamp(u, -7.0, 7.0);
    return (uc + 1.0) * (gc * at::sigmoid(gc * 1.702));
  }
  return at::silu(g) * u;  // kinds 0 and 2 are the same in vLLM
}

}  // namespace

at::Tensor moe_forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w13, const at::Tensor& w2, int64_t hidden, int64_t inter,
                       int64_t group_size, bool weight_on_input, int64_t activation) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden, "x must be [T, H] with H=", hidden);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0), "topk_ids must be [T, K]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must match topk_ids");
  TORCH_CHECK(w13.dim() == 2 && w2.dim() == 2 && w13.size(0) == w2.size(0),
              "w13_packed and w2_packed must be [E, bytes] with the same E");
  TORCH_CHECK(activation >= 0 && activation <= 2, "activation kind must be 0, 1 or 2");

  const int64_t T = x.size(0), K = topk_ids.size(1), E = w13.size(0);
  const bool channelwise = group_size == -1;
  const int64_t g13 = channelwise ? hidden : group_size;
  const int64_t g2 = channelwise ? inter : group_size;
  const auto cdt = compute_dtype(x.scalar_type(), channelwise);

  auto ids = topk_ids.to(at::kLong).contiguous();
  auto gates = topk_weights.to(at::kFloat).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* gp = gates.data_ptr<float>();

  // counting sort: offsets[e]..offsets[e+1] are expert e's (token, gate) pairs, tokens ascending
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t i = 0; i < T * K; ++i) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < E, "expert id ", idp[i], " out of range [0, ", E, ")");
    offsets[idp[i] + 1]++;
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  auto tok = at::empty({T * K}, at::kLong);
  auto gsorted = at::empty({T * K}, at::kFloat);
  int64_t* tp = tok.data_ptr<int64_t>();
  float* gsp = gsorted.data_ptr<float>();
  {
    std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) {
        const int64_t p = fill[idp[t * K + j]]++;
        tp[p] = t;
        gsp[p] = gp[t * K + j];
      }
  }

  auto x_all = x.index_select(0, tok).to(cdt);
  auto gcol = gsorted.to(cdt).unsqueeze(1);
  if (weight_on_input) x_all = x_all * gcol;
  auto y_all = at::zeros({T * K, hidden}, x_all.options());

  at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t b = offsets[e], n = offsets[e + 1] - b;
      if (n == 0) continue;
      auto xe = x_all.narrow(0, b, n);
      auto y13 = mm(xe, w13[e], g13, hidden, 2 * inter);
      auto act = activate(y13, inter, activation);
      y_all.narrow(0, b, n).copy_(mm(act, w2[e], g2, inter, hidden));
    }
  });

  if (!weight_on_input) y_all = y_all * gcol;
  auto out = at::zeros({T, hidden}, y_all.options());
  out.index_add_(0, tok, y_all);
  return out.to(x.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_forward", &moe_forward, "W4A8 MoE forward (vLLM dynamic_4bit_int_moe_cpu algorithm)",
        py::arg("x"), py::arg("topk_ids"), py::arg("topk_weights"), py::arg("w13_packed"),
        py::arg("w2_packed"), py::arg("hidden"), py::arg("inter"), py::arg("group_size"),
        py::arg("apply_router_weight_on_input"), py::arg("activation"));
}
