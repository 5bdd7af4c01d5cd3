// Adam/AdamW over one chunk's host-resident state in a single pass: reads the low-precision
// gradient, updates the fp32 master, exp_avg and exp_avg_sq, and writes the rounded parameter
// copy that goes back to the GPU -- in place over the gradient, element by element. It can also
// copy the gradient aside in the same pass (`kept`), and take back or retake a step from that copy
// (`adam_revise_`), which is how ZeRO-Cache updates during backward before the clip factor is known
// (zero_cache/revision.py explains the scheme).
//
// Why native: the library path (DeepSpeed's cpu_adam, torch's fused CPU Adam) needs the gradient
// in fp32 and the parameter rounded in separate passes: 40 bytes of memory traffic per element
// instead of 28 here (2 gradient + 12 state read + 12 state written + 2 parameter; 30 with the kept
// copy). The loops are plain scalar code that the compiler vectorises (-O3 -march=native
// -fno-math-errno: sqrt must not set errno to vectorise) and OpenMP spreads over the cores it is
// given (all but the training thread's, which must keep launching GPU kernels).
//
// Numerics follow torch's fused Adam: decoupled decay p *= 1 - lr*wd (AdamW) or g += wd*p (Adam),
// m = m + (1 - b1)(g - m), v = b2 v + (1 - b2) g^2, p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).
// The inverse runs those lines backwards: p = (p + lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)) / (1 - lr*wd)
// (or g += wd*p after the add), m = (m - (1 - b1) g) / b1, v = max(0, (v - (1 - b2) g^2) / b2), and at
// step 1 m = v = 0 exactly (what they were before the first step).

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

// Element access by storage type: bf16 travels as its 16 bits.
inline float load(const uint16_t x) { return bf16_to_float(x); }
inline float load(const float x) { return x; }
inline void store(uint16_t& x, float f) { x = float_to_bf16(f); }
inline void store(float& x, float f) { x = f; }

// One step; g_out holds the gradient and receives the rounded weight; with Keep, the gradient is
// copied to `kept` as it is read.
template <bool Decoupled, bool Keep, typename T>
void step(float* __restrict p, T* g_out, T* kept, float* __restrict m, float* __restrict v, int64_t n,
          const Hyper h) {
#pragma omp parallel for simd schedule(static) num_threads(h.threads)
  for (int64_t i = 0; i < n; ++i) {
    const T raw = g_out[i];
    if constexpr (Keep) kept[i] = raw;
    const float updated = adam_element<Decoupled>(p[i], load(raw), m[i], v[i], h);
    p[i] = updated;
    store(g_out[i], updated);
  }
}

// Takes back the step made from `grad` with `undo` (its grad_scale) and/or makes it with `redo`, then
// writes the rounded weight to `out`.
template <bool Decoupled, typename G, typename O>
void revise(float* __restrict p, const G* __restrict grad, O* __restrict out, float* __restrict m,
            float* __restrict v, int64_t n, const Hyper* undo, const Hyper* redo, bool first_step) {
  const int threads = undo ? undo->threads : redo->threads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    float weight = p[i];
    if (undo) {
      const Hyper& h = *undo;
      float g = load(grad[i]) * h.grad_scale;
      weight += h.step_size * m[i] / (std::sqrt(v[i]) * h.inv_sqrt_bc2 + h.eps);
      if constexpr (Decoupled) {
        weight /= 1.0f - h.lr * h.weight_decay;
      } else {
        g += h.weight_decay * weight;
      }
      m[i] = first_step ? 0.0f : (m[i] - (1.0f - h.beta1) * g) / h.beta1;
      v[i] = first_step ? 0.0f : std::fmax(0.0f, (v[i] - (1.0f - h.beta2) * g * g) / h.beta2);
    }
    if (redo) weight = adam_element<Decoupled>(weight, load(grad[i]), m[i], v[i], *redo);
    p[i] = weight;
    store(out[i], weight);
  }
}

template <typename G>
void revise_into(torch::Tensor out, float* p, const G* grad, float* m, float* v, int64_t n, const Hyper* undo,
                 const Hyper* redo, bool first_step, bool decoupled) {
  switch (out.scalar_type()) {
    case torch::kBFloat16: {
      auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      decoupled ? revise<true>(p, grad, o, m, v, n, undo, redo, first_step)
                : revise<false>(p, grad, o, m, v, n, undo, redo, first_step);
      break;
    }
    case torch::kFloat32: {
      float* o = out.data_ptr<float>();
      decoupled ? revise<true>(p, grad, o, m, v, n, undo, redo, first_step)
                : revise<false>(p, grad, o, m, v, n, undo, redo, first_step);
      break;
    }
    default:
      TORCH_CHECK(false, "out must be bf16 or fp32, got ", out.scalar_type());
  }
}

void check_states(const torch::Tensor& master, const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq) {
  TORCH_CHECK(master.device().is_cpu() && master.scalar_type() == torch::kFloat32 && master.is_contiguous(),
              "master must be a contiguous fp32 CPU tensor");
  for (const auto& t : {exp_avg, exp_avg_sq}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() &&
                    t.numel() == master.numel(),
                "exp_avg and exp_avg_sq must be contiguous fp32 CPU tensors shaped like master");
  }
}

void check_like(const torch::Tensor& t, const torch::Tensor& master, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == master.numel(), name,
              " must be a contiguous CPU tensor shaped like master");
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kFloat32, name,
              " must be bf16 or fp32, got ", t.scalar_type());
}

Hyper make_hyper(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                 double grad_scale, int64_t threads) {
  TORCH_CHECK(step >= 1, "step counts from 1");
  TORCH_CHECK(threads >= 1, "threads must be at least 1");
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return Hyper{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(eps),
               static_cast<float>(weight_decay), static_cast<float>(grad_scale), static_cast<float>(lr / bc1),
               static_cast<float>(1.0 / std::sqrt(bc2)), static_cast<int>(threads)};
}

}  // namespace

// grad_and_out holds the gradient on entry and the updated parameter (its dtype) on return; a defined
// `kept` (same dtype and size) receives a copy of the gradient.
void fused_adam_(torch::Tensor master, torch::Tensor grad_and_out, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                 int64_t step_count, double lr, double beta1, double beta2, double eps, double weight_decay,
                 double grad_scale, bool decoupled, int64_t threads, c10::optional<torch::Tensor> kept) {
  check_states(master, exp_avg, exp_avg_sq);
  check_like(grad_and_out, master, "grad_and_out");
  const bool keep = kept.has_value() && kept->defined();
  if (keep) {
    check_like(*kept, master, "kept");
    TORCH_CHECK(kept->scalar_type() == grad_and_out.scalar_type(), "kept must have grad_and_out's dtype");
  }
  const Hyper h = make_hyper(step_count, lr, beta1, beta2, eps, weight_decay, grad_scale, threads);
  const int64_t n = master.numel();
  float* p = master.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  if (grad_and_out.scalar_type() == torch::kBFloat16) {
    auto* g = reinterpret_cast<uint16_t*>(grad_and_out.data_ptr<at::BFloat16>());
    auto* k = keep ? reinterpret_cast<uint16_t*>(kept->data_ptr<at::BFloat16>()) : nullptr;
    if (decoupled) {
      keep ? step<true, true>(p, g, k, m, v, n, h) : step<true, false>(p, g, k, m, v, n, h);
    } else {
      keep ? step<false, true>(p, g, k, m, v, n, h) : step<false, false>(p, g, k, m, v, n, h);
    }
  } else {
    float* g = grad_and_out.data_ptr<float>();
    float* k = keep ? kept->data_ptr<float>() : nullptr;
    if (decoupled) {
      keep ? step<true, true>(p, g, k, m, v, n, h) : step<true, false>(p, g, k, m, v, n, h);
    } else {
      keep ? step<false, true>(p, g, k, m, v, n, h) : step<false, false>(p, g, k, m, v, n, h);
    }
  }
}

// Revise one chunk's step: with undo_scale > 0, take back the step `step_count` made from `grad` times
// undo_scale; with redo_scale > 0, then make it from `grad` times redo_scale. The rounded weight goes to `out`.
void adam_revise_(torch::Tensor master, torch::Tensor grad, torch::Tensor out, torch::Tensor exp_avg,
                  torch::Tensor exp_avg_sq, int64_t step_count, double lr, double beta1, double beta2, double eps,
                  double weight_decay, double undo_scale, double redo_scale, bool decoupled, int64_t threads) {
  check_states(master, exp_avg, exp_avg_sq);
  check_like(grad, master, "grad");
  check_like(out, master, "out");
  TORCH_CHECK(undo_scale > 0 || redo_scale > 0, "nothing to revise: give undo_scale or redo_scale");
  const Hyper undo = make_hyper(step_count, lr, beta1, beta2, eps, weight_decay, undo_scale, threads);
  const Hyper redo = make_hyper(step_count, lr, beta1, beta2, eps, weight_decay, redo_scale, threads);
  const Hyper* undo_ptr = undo_scale > 0 ? &undo : nullptr;
  const Hyper* redo_ptr = redo_scale > 0 ? &redo : nullptr;
  const int64_t n = master.numel();
  float* p = master.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  if (grad.scalar_type() == torch::kBFloat16) {
    const auto* g = reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>());
    revise_into(out, p, g, m, v, n, undo_ptr, redo_ptr, step_count == 1, decoupled);
  } else {
    revise_into(out, p, grad.data_ptr<float>(), m, v, n, undo_ptr, redo_ptr, step_count == 1, decoupled);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // The GIL is released: the training thread keeps launching GPU work while this runs on the
  // ZeRO-Cache worker (pybind11 would otherwise hold it for the whole call).
  module.def("fused_adam_", &fused_adam_, "One Adam/AdamW step, gradient in and rounded parameter out in place",
             pybind11::arg("master"), pybind11::arg("grad_and_out"), pybind11::arg("exp_avg"),
             pybind11::arg("exp_avg_sq"), pybind11::arg("step"), pybind11::arg("lr"), pybind11::arg("beta1"),
             pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("weight_decay"), pybind11::arg("grad_scale"),
             pybind11::arg("decoupled"), pybind11::arg("threads"), pybind11::arg("kept") = pybind11::none(),
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("adam_revise_", &adam_revise_, "Take back and/or retake one Adam/AdamW step from a kept gradient",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
