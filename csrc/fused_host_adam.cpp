// Adam/AdamW over one chunk's host-resident state in a single pass: reads the low-precision
// gradient, updates the fp32 master, exp_avg and exp_avg_sq, and writes the rounded parameter
// copy that goes back to the GPU -- in place over the gradient, element by element.
//
// It also serves ZeRO-Cache's updates during backward, made before the clip factor is known
// (zero_cache/revision.py explains the scheme): the step can copy its gradient aside (`kept`) and
// leave the moments unstepped (`lazy`: the new weight is written, m and v are not); the next step
// folds that kept gradient into m and v in the same pass (`fold_scale`), or `adam_fold_` does it
// alone; and `adam_revise_` takes back or retakes a step from the kept gradient.
//
// Why native: the library path (DeepSpeed's cpu_adam, torch's fused CPU Adam) needs the gradient
// in fp32 and the parameter rounded in separate passes: 40 bytes of memory traffic per element
// instead of 28 here (2 gradient + 12 state read + 12 state written + 2 parameter; a lazy step that
// keeps its gradient and folds the previous one moves 32). The loops are plain scalar code that the
// compiler vectorises (-O3 -march=native -fno-math-errno: sqrt must not set errno to vectorise) and
// OpenMP spreads over the cores it is given (all but the training thread's, which must keep
// launching GPU kernels).
//
// Numerics follow torch's fused Adam: decoupled decay p *= 1 - lr*wd (AdamW) or g += wd*p (Adam),
// m = m + (1 - b1)(g - m), v = b2 v + (1 - b2) g^2, p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).
// A fold runs the same moment lines on the same scaled gradient, so a lazy step folded later leaves
// bit for bit the states of an eager one. Taking back a lazy step needs the weight line alone run
// backwards: p = (p + lr/bc1 * m' / (sqrt(v')/sqrt(bc2) + eps)) / (1 - lr*wd), with m' and v' the
// unstored moments recomputed; the moments were never touched. Taking back an eager step (Adam with
// L2 decay, whose moments read the old weight) also runs the moment lines backwards:
// m = (m - (1 - b1) g) / b1, v = max(0, (v - (1 - b2) g^2) / b2), and at step 1 m = v = 0 exactly.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

// The moment lines, on a gradient already scaled (and, for Adam, with its L2 term added).
inline void step_moments(float g, float& m, float& v, const Hyper& h) {
  m = m + (1.0f - h.beta1) * (g - m);
  v = h.beta2 * v + (1.0f - h.beta2) * g * g;
}

inline float adam_delta(float m, float v, const Hyper& h) {
  return h.step_size * m / (std::sqrt(v) * h.inv_sqrt_bc2 + h.eps);
}

// The element update; Decoupled is a template parameter so the loop body has no branch.
template <bool Decoupled>
inline float adam_element(float p, float g, float& m, float& v, const Hyper& h) {
  g *= h.grad_scale;
  if constexpr (Decoupled) {
    p *= 1.0f - h.lr * h.weight_decay;
  } else {
    g += h.weight_decay * p;
  }
  step_moments(g, m, v, h);
  return p - adam_delta(m, v, h);
}

// Element access by storage type: bf16 travels as its 16 bits.
inline float load(const uint16_t x) { return bf16_to_float(x); }
inline float load(const float x) { return x; }
inline float load(const at::Half x) { return static_cast<float>(x); }
inline void store(uint16_t& x, float f) { x = float_to_bf16(f); }
inline void store(float& x, float f) { x = f; }

// One step; g_out holds the gradient and receives the rounded weight. Keep: the gradient is copied to
// `kept` as it is read. Fold: first, the gradient `kept` held (times f.grad_scale) is folded into m and v.
// Lazy: this step's moments are not stored (m and v keep their folded values).
template <bool Decoupled, bool Keep, bool Fold, bool Lazy, typename T>
void step(float* __restrict p, T* g_out, T* kept, float* __restrict m, float* __restrict v, int64_t n,
          const Hyper h, const Hyper f) {
#pragma omp parallel for simd schedule(static) num_threads(h.threads)
  for (int64_t i = 0; i < n; ++i) {
    const T raw = g_out[i];
    float m_i = m[i], v_i = v[i];
    if constexpr (Fold) step_moments(load(kept[i]) * f.grad_scale, m_i, v_i, f);
    if constexpr (Keep) kept[i] = raw;
    float m_new = m_i, v_new = v_i;
    const float updated = adam_element<Decoupled>(p[i], load(raw), m_new, v_new, h);
    p[i] = updated;
    store(g_out[i], updated);
    if constexpr (!Lazy) {
      m[i] = m_new;
      v[i] = v_new;
    } else if constexpr (Fold) {
      m[i] = m_i;
      v[i] = v_i;
    }
  }
}

template <typename T>
void fold(const T* __restrict kept, float* __restrict m, float* __restrict v, int64_t n, const Hyper f) {
#pragma omp parallel for simd schedule(static) num_threads(f.threads)
  for (int64_t i = 0; i < n; ++i) {
    float m_i = m[i], v_i = v[i];
    step_moments(load(kept[i]) * f.grad_scale, m_i, v_i, f);
    m[i] = m_i;
    v[i] = v_i;
  }
}

// Calls fn(std::true_type) or fn(std::false_type): a runtime flag as a template argument.
template <typename Fn>
void with_flag(bool flag, Fn&& fn) {
  if (flag) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// Takes back the step made from `grad` with `undo` (its grad_scale) and/or makes it with `redo`, then
// writes the rounded weight to `out`. UndoLazy: the step taken back stored no moments (only the weight
// line runs backwards). RedoLazy: the step made stores none either.
template <bool Decoupled, bool UndoLazy, bool RedoLazy, typename G, typename O>
void revise(float* __restrict p, const G* __restrict grad, O* __restrict out, float* __restrict m,
            float* __restrict v, int64_t n, const Hyper* undo, const Hyper* redo, bool first_step) {
  const int threads = undo ? undo->threads : redo->threads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    float weight = p[i], m_i = m[i], v_i = v[i];
    if (undo) {
      const Hyper& h = *undo;
      float g = load(grad[i]) * h.grad_scale;
      if constexpr (UndoLazy) {  // (Adam's L2 term is refused with lazy steps: its gradient reads the old weight)
        float m_step = m_i, v_step = v_i;
        step_moments(g, m_step, v_step, h);
        weight += adam_delta(m_step, v_step, h);
        if constexpr (Decoupled) weight /= 1.0f - h.lr * h.weight_decay;
      } else {
        weight += adam_delta(m_i, v_i, h);
        if constexpr (Decoupled) {
          weight /= 1.0f - h.lr * h.weight_decay;
        } else {
          g += h.weight_decay * weight;
        }
        m_i = first_step ? 0.0f : (m_i - (1.0f - h.beta1) * g) / h.beta1;
        v_i = first_step ? 0.0f : std::fmax(0.0f, (v_i - (1.0f - h.beta2) * g * g) / h.beta2);
      }
    }
    if (redo) {
      float m_new = m_i, v_new = v_i;
      weight = adam_element<Decoupled>(weight, load(grad[i]), m_new, v_new, *redo);
      if constexpr (!RedoLazy) {
        m_i = m_new;
        v_i = v_new;
      }
    }
    p[i] = weight;
    m[i] = m_i;
    v[i] = v_i;
    store(out[i], weight);
  }
}

template <typename G>
void revise_into(torch::Tensor out, float* p, const G* grad, float* m, float* v, int64_t n, const Hyper* undo,
                 const Hyper* redo, bool first_step, bool decoupled, bool undo_lazy, bool redo_lazy) {
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kFloat32,
              "out must be bf16 or fp32, got ", out.scalar_type());
  with_flag(decoupled, [&](auto d) {
    with_flag(undo_lazy, [&](auto ul) {
      with_flag(redo_lazy, [&](auto rl) {
        constexpr bool D = decltype(d)::value, UL = decltype(ul)::value, RL = decltype(rl)::value;
        if (out.scalar_type() == torch::kBFloat16) {
          auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
          revise<D, UL, RL>(p, grad, o, m, v, n, undo, redo, first_step);
        } else {
          revise<D, UL, RL>(p, grad, out.data_ptr<float>(), m, v, n, undo, redo, first_step);
        }
      });
    });
  });
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

template <typename T>
void step_dispatch(float* p, T* g, T* kept, float* m, float* v, int64_t n, const Hyper& h, const Hyper& f,
                   bool decoupled, bool keep, bool folding, bool lazy) {
  with_flag(decoupled, [&](auto d) {
    with_flag(keep, [&](auto k) {
      with_flag(folding, [&](auto fo) {
        with_flag(lazy, [&](auto l) {
          constexpr bool D = decltype(d)::value, K = decltype(k)::value, F = decltype(fo)::value,
                         L = decltype(l)::value;
          step<D, K, F, L>(p, g, kept, m, v, n, h, f);
        });
      });
    });
  });
}

// grad_and_out holds the gradient on entry and the updated parameter (its dtype) on return. A defined
// `kept` (same dtype and size) receives a copy of the gradient; with fold_scale > 0 the gradient it held
// before (a lazy step's) is first folded into the moments with that scale and this step's betas; with
// `lazy` this step's moments are not stored.
void fused_adam_(torch::Tensor master, torch::Tensor grad_and_out, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                 int64_t step_count, double lr, double beta1, double beta2, double eps, double weight_decay,
                 double grad_scale, bool decoupled, int64_t threads, c10::optional<torch::Tensor> kept, bool lazy,
                 double fold_scale) {
  check_states(master, exp_avg, exp_avg_sq);
  check_like(grad_and_out, master, "grad_and_out");
  const bool keep = kept.has_value() && kept->defined();
  if (keep) {
    check_like(*kept, master, "kept");
    TORCH_CHECK(kept->scalar_type() == grad_and_out.scalar_type(), "kept must have grad_and_out's dtype");
  }
  TORCH_CHECK(keep || (!lazy && fold_scale == 0), "a lazy step or a fold needs `kept`");
  TORCH_CHECK(!lazy || decoupled || weight_decay == 0, "a lazy step with Adam's L2 decay cannot be taken back");
  const Hyper h = make_hyper(step_count, lr, beta1, beta2, eps, weight_decay, grad_scale, threads);
  const Hyper f = make_hyper(step_count, lr, beta1, beta2, eps, weight_decay, fold_scale, threads);
  const int64_t n = master.numel();
  float* p = master.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  if (grad_and_out.scalar_type() == torch::kBFloat16) {
    auto* g = reinterpret_cast<uint16_t*>(grad_and_out.data_ptr<at::BFloat16>());
    auto* k = keep ? reinterpret_cast<uint16_t*>(kept->data_ptr<at::BFloat16>()) : nullptr;
    step_dispatch(p, g, k, m, v, n, h, f, decoupled, keep, fold_scale > 0, lazy);
  } else {
    float* k = keep ? kept->data_ptr<float>() : nullptr;
    step_dispatch(p, grad_and_out.data_ptr<float>(), k, m, v, n, h, f, decoupled, keep, fold_scale > 0, lazy);
  }
}

// Fold a lazy step's gradient (`kept` times `scale`) into the moments: what that step left unstored. Also
// for fp16 gradients, which the library kernels step (one pass here against four of torch's).
void adam_fold_(torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor kept, double scale, double beta1,
                double beta2, int64_t threads) {
  check_states(exp_avg, exp_avg, exp_avg_sq);
  if (kept.scalar_type() == torch::kHalf) {
    TORCH_CHECK(kept.device().is_cpu() && kept.is_contiguous() && kept.numel() == exp_avg.numel(),
                "kept must be a contiguous CPU tensor shaped like exp_avg");
    const Hyper f = make_hyper(1, 0.0, beta1, beta2, 0.0, 0.0, scale, threads);
    fold(kept.data_ptr<at::Half>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), kept.numel(), f);
    return;
  }
  check_like(kept, exp_avg, "kept");
  const Hyper f = make_hyper(1, 0.0, beta1, beta2, 0.0, 0.0, scale, threads);
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  if (kept.scalar_type() == torch::kBFloat16) {
    fold(reinterpret_cast<const uint16_t*>(kept.data_ptr<at::BFloat16>()), m, v, kept.numel(), f);
  } else {
    fold(kept.data_ptr<float>(), m, v, kept.numel(), f);
  }
}

// Revise one chunk's step: with undo_scale > 0, take back the step `step_count` made from `grad` times
// undo_scale (undo_lazy: a lazy step, which stored no moments); with redo_scale > 0, then make it from
// `grad` times redo_scale (redo_lazy: storing no moments). The rounded weight goes to `out`.
void adam_revise_(torch::Tensor master, torch::Tensor grad, torch::Tensor out, torch::Tensor exp_avg,
                  torch::Tensor exp_avg_sq, int64_t step_count, double lr, double beta1, double beta2, double eps,
                  double weight_decay, double undo_scale, double redo_scale, bool decoupled, int64_t threads,
                  bool undo_lazy, bool redo_lazy) {
  check_states(master, exp_avg, exp_avg_sq);
  check_like(grad, master, "grad");
  check_like(out, master, "out");
  TORCH_CHECK(undo_scale > 0 || redo_scale > 0, "nothing to revise: give undo_scale or redo_scale");
  TORCH_CHECK(!(undo_lazy || redo_lazy) || decoupled || weight_decay == 0,
              "a lazy step with Adam's L2 decay cannot be taken back");
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
    revise_into(out, p, g, m, v, n, undo_ptr, redo_ptr, step_count == 1, decoupled, undo_lazy, redo_lazy);
  } else {
    revise_into(out, p, grad.data_ptr<float>(), m, v, n, undo_ptr, redo_ptr, step_count == 1, decoupled, undo_lazy,
                redo_lazy);
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
             pybind11::arg("lazy") = false, pybind11::arg("fold_scale") = 0.0,
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("adam_fold_", &adam_fold_, "Fold a lazy step's kept gradient into the Adam moments",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("adam_revise_", &adam_revise_, "Take back and/or retake one Adam/AdamW step from a kept gradient",
             pybind11::arg("master"), pybind11::arg("grad"), pybind11::arg("out"), pybind11::arg("exp_avg"),
             pybind11::arg("exp_avg_sq"), pybind11::arg("step"), pybind11::arg("lr"), pybind11::arg("beta1"),
             pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("weight_decay"), pybind11::arg("undo_scale"),
             pybind11::arg("redo_scale"), pybind11::arg("decoupled"), pybind11::arg("threads"),
             pybind11::arg("undo_lazy") = false, pybind11::arg("redo_lazy") = false,
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
