// Adam/AdamW over one chunk's host-resident state in a single pass: reads the low-precision
// gradient, updates the fp32 master, exp_avg and exp_avg_sq, and writes the rounded parameter
// copy that goes back to the GPU -- in place over the gradient, element by element.
//
// Why native: the library path (DeepSpeed's cpu_adam, torch's fused CPU Adam) needs the gradient
// in fp32 and the parameter rounded in separate passes: 40 bytes of memory traffic per element
// instead of 28 here (2 gradient + 12 state read + 12 state written + 2 parameter). The loops are
// plain scalar code that the compiler vectorises (-O3 -march=native -fno-math-errno: sqrt must not
// set errno to vectorise) and OpenMP spreads over the cores it is given (all but the training
// thread's, which must keep launching GPU kernels).
//
// Numerics follow torch's fused Adam: decoupled decay p *= 1 - lr*wd (AdamW) or g += wd*p (Adam),
// m = m + (1 - b1)(g - m), v = b2 v + (1 - b2) g^2, p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN (branch-free, so it vectorises)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

struct Hyper {
  float lr, beta1, beta2, eps, weight_decay, grad_scale, step_size, inv_sqrt_bc2;
  int threads;
};

// The element update; Decoupled is a template parameter so the loop body has no branch.
template <bool Decoupled>
inline float adam_element(float p, float g, float& m, float& v, const Hyper& h) {
  g *= h.grad_scale;
  if constexpr (Decoupled) {
    p *= 1.0f - h.lr * h.weight_decay;
  } else {
    g += h.weight_decay * p;
  }
  const float m_new = m + (1.0f - h.beta1) * (g - m);
  const float v_new = h.beta2 * v + (1.0f - h.beta2) * g * g;
  m = m_new;
  v = v_new;
  return p - h.step_size * m_new / (std::sqrt(v_new) * h.inv_sqrt_bc2 + h.eps);
}

template <bool Decoupled>
void step_bf16(float* __restrict p, uint16_t* __restrict g_out, float* __restrict m, float* __restrict v, int64_t n,
               const Hyper h) {
#pragma omp parallel for simd schedule(static) num_threads(h.threads)
  for (int64_t i = 0; i < n; ++i) {
    const float updated = adam_element<Decoupled>(p[i], bf16_to_float(g_out[i]), m[i], v[i], h);
    p[i] = updated;
    g_out[i] = float_to_bf16(updated);
  }
}

template <bool Decoupled>
void step_fp32(float* __restrict p, float* __restrict g_out, float* __restrict m, float* __restrict v, int64_t n,
               const Hyper h) {
#pragma omp parallel for simd schedule(static) num_threads(h.threads)
  for (int64_t i = 0; i < n; ++i) {
    const float updated = adam_element<Decoupled>(p[i], g_out[i], m[i], v[i], h);
    p[i] = updated;
    g_out[i] = updated;
  }
}

}  // namespace

// grad_and_out holds the gradient on entry and the updated parameter (its dtype) on return.
void fused_adam_(torch::Tensor master, torch::Tensor grad_and_out, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                 int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                 double grad_scale, bool decoupled, int64_t threads) {
  TORCH_CHECK(master.device().is_cpu() && master.scalar_type() == torch::kFloat32 && master.is_contiguous(),
              "master must be a contiguous fp32 CPU tensor");
  for (const auto& t : {exp_avg, exp_avg_sq}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() &&
                    t.numel() == master.numel(),
                "exp_avg and exp_avg_sq must be contiguous fp32 CPU tensors shaped like master");
  }
  TORCH_CHECK(grad_and_out.device().is_cpu() && grad_and_out.is_contiguous() &&
                  grad_and_out.numel() == master.numel(),
              "grad_and_out must be a contiguous CPU tensor shaped like master");
  TORCH_CHECK(step >= 1, "step counts from 1");
  TORCH_CHECK(threads >= 1, "threads must be at least 1");
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const Hyper h{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(eps),
                static_cast<float>(weight_decay), static_cast<float>(grad_scale), static_cast<float>(lr / bc1),
                static_cast<float>(1.0 / std::sqrt(bc2)), static_cast<int>(threads)};
  const int64_t n = master.numel();
  float* p = master.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  switch (grad_and_out.scalar_type()) {
    case torch::kBFloat16: {
      auto* g = reinterpret_cast<uint16_t*>(grad_and_out.data_ptr<at::BFloat16>());
      decoupled ? step_bf16<true>(p, g, m, v, n, h) : step_bf16<false>(p, g, m, v, n, h);
      break;
    }
    case torch::kFloat32: {
      float* g = grad_and_out.data_ptr<float>();
      decoupled ? step_fp32<true>(p, g, m, v, n, h) : step_fp32<false>(p, g, m, v, n, h);
      break;
    }
    default:
      TORCH_CHECK(false, "grad_and_out must be bf16 or fp32, got ", grad_and_out.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // The GIL is released: the training thread keeps launching GPU work while this runs on the
  // ZeRO-Cache worker (pybind11 would otherwise hold it for the whole call).
  module.def("fused_adam_", &fused_adam_, "One Adam/AdamW step, gradient in and rounded parameter out in place",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
