"""One-token decode attention on CPU in one pass over the cache: the batched vanilla step of the answerer.

A batched decode step asks every row's one new query to read its whole cache. transformers runs it through torch's
flash kernel for CPU, which with one query row per group streams the target's cache at ~8 GB/s where this class of
host reads ~30-60 GB/s, and the cache's layers are prefix views of a buffer with spare slots (`infer.attention.
SlackCache`), which `bmm` copies first (docs/decisions.md, "One answerer"). This kernel reads the keys and values
in place, 64 slots at a time, one task per row and key/value head: the block's scores against the group's query rows
(fp32), a running softmax (max and sum), the block's values added, so the cache is read from memory once. With
AVX-512 and a head size that is a multiple of 16 the products of 16 keys are reduced together and the group's value
sums stay in registers, each value row widened once for all of them; with AVX512-BF16 a bf16 cache's scores
multiply the keys as stored (bf16 pairs, exact products, fp32 sums), where widening them was most of the kernel's
time. Elsewhere the same loops are left to the compiler's vectorizer. A row starts at the block of its first slot the
mask lets it read: the rows of a batch share one width, left-padded to the longest context, and the blocks before a
short row's context add exactly nothing.

`decode_attention` is registered with transformers' ``AttentionInterface`` as `NAME`; a masked forward of several
query rows with grouped key / value heads (a verified draft, a padded prefill) goes to torch's SDPA with the heads
shared (``enable_gqa``), where HF's SDPA function would copy every cached key and value once per query head of a
group; `VERIFY_NAME` (`verify_attention`) is that route alone, HF's SDPA function everywhere else, and is what a served
CPU target runs (`serve_shared_heads`, from `infer.serving.prepare_target`). Any other forward with more than one
query per row, a device other than the CPU, a dtype other than fp32 / bf16, a layout the kernel does not read (keys
or values not contiguous along the head dimension, a mask per head) or a model feature it lacks (a sliding window,
logit soft-capping, attention sinks) goes to HF's SDPA function unchanged. The kernel is compiled on first use
(torch's C++ extension loader, ``-O3 -march=native``, OpenMP) into torch's extension cache, named by a hash of its
source and of this CPU's flags, so a cache shared by different CPUs never hands one a binary built for another.
`infer.continuous.decode_continuous` (every self-distillation path) serves its steps through it on the CPU
(`one_pass_decode`); `available` says whether it could be built (a host without a compiler keeps the SDPA path). Accuracy: fp32 scores,
softmax and sums, as SDPA keeps them; the output rounded once to the input dtype.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "drafters_cpu_decode"
"""The attention implementation name registered with transformers."""
VERIFY_NAME = "drafters_cpu_verify"
"""A served target's implementation (`serve_shared_heads`): HF's SDPA function but for masked grouped calls of
several query rows, which read the grouped heads in place (`verify_attention`)."""

ENV_VAR = "DRAFTERS_CPU_DECODE_ATTENTION"
"""``0`` keeps every call on SDPA (for A/B timing and for hosts where the build misbehaves)."""

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 64;  // keys per block: their fp32 copy (16 KB at 64 dims) stays in L1

inline float widen(at::BFloat16 x) {  // bf16 is fp32's top half
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float widen(float x) { return x; }

template <typename T>
inline void widen_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

template <typename T>
inline void axpy(float w, const T* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * widen(x[i]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}


// exp for x <= 0 without a call, so the compiler vectorizes the loop around it: 2^n * p(r), r = x - n ln 2, with a
// degree-6 polynomial (relative error ~2e-7, as expf); exactly 0 below -87.3, where expf is subnormal or 0, which
// is what masked keys (score + dtype-min) must contribute.
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.3f);
  const float n = std::nearbyint(xc * 1.44269504f);
  const float r = xc - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.3f ? 0.f : p * scale;
}

#if defined(__AVX512F__)
inline __m512 load16(const at::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }

// lane j of the result = the sum of v[j]'s 16 lanes: pairs inside 128-bit lanes, then quads, then across them
inline __m512 sum_lanes16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(__AVX512F__)
// p[g][j] for 16 keys at a time, g < G: ``at_query(g)`` gives row g's ``partial(key row)``, the key's products with
// it as 16-lane partial sums; the 16 keys' partial sums are reduced together (one horizontal sum per key would cost
// more than the products). Each key's row is read once for every query row of the group.
template <typename T, typename AtQuery>
inline void scores16(const T* k, int64_t ks, int64_t n, int64_t G, float* p, AtQuery at_query) {
  __m512 part[16];
  for (int64_t g = 0; g < G; ++g) {
    const auto partial = at_query(g);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - j0);
      for (int64_t j = 0; j < 16; ++j) part[j] = j < m ? partial(k + (j0 + j) * ks) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(p + g * BLOCK + j0, static_cast<__mmask16>((1u << m) - 1), sum_lanes16(part));
    }
  }
}
#endif

// p[g][j] = q_g . k_j for the n <= BLOCK keys from k (rows ks apart), g < G. With AVX-512 and a constant head
// dimension, 16 keys at a time (`scores16`). Where the CPU multiplies bf16 pairs (AVX512-BF16) bf16 keys are not
// widened: the query's bf16 copy qb (exact: the query came in bf16 and is not scaled yet) times 32 key elements per
// instruction, the products exact, summed in fp32. Otherwise the block is widened into kf and each score is a dot
// product.
template <typename T, int64_t DIM>
inline void block_scores(const T* k, int64_t ks, int64_t n, const float* q, const at::BFloat16* qb, int64_t G,
                         int64_t D, float* kf, float* p) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16> && DIM > 0 && DIM % 32 == 0) {
    constexpr int64_t C = DIM / 32;
    scores16(k, ks, n, G, p, [&](int64_t g) {
      struct { __m512bh c[C]; } qc;  // a struct, so the lambda below holds the registers by value
      for (int64_t c = 0; c < C; ++c) qc.c[c] = (__m512bh)_mm512_loadu_si512(qb + g * DIM + 32 * c);
      return [=](const T* row) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t c = 0; c < C; ++c) s = _mm512_dpbf16_ps(s, qc.c[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
        return s;
      };
    });
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (DIM > 0 && DIM % 16 == 0) {
    constexpr int64_t C = DIM / 16;
    scores16(k, ks, n, G, p, [&](int64_t g) {
      struct { __m512 c[C]; } qc;
      for (int64_t c = 0; c < C; ++c) qc.c[c] = _mm512_loadu_ps(q + g * DIM + 16 * c);
      return [=](const T* row) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t c = 0; c < C; ++c) s = _mm512_fmadd_ps(qc.c[c], load16(row + 16 * c), s);
        return s;
      };
    });
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) widen_row(k + j * ks, kf + j * D, D);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < n; ++j) p[g * BLOCK + j] = dot(q + g * D, kf + j * D, D);
}

// acc[g] += sum_j p[g][j] v_j over the block's n values (rows vs apart). With AVX-512 and a constant head dimension
// each query row's sums stay in registers across the block.
template <typename T, int64_t DIM>
inline void block_values(const T* v, int64_t vs, int64_t n, const float* p, int64_t G, int64_t D, float* acc) {
#if defined(__AVX512F__)
  if constexpr (DIM > 0 && DIM % 16 == 0 && DIM <= 64) {
    // up to 4 query rows: their sums (4 x 4 registers at 64 dims) stay in registers and each value row is widened
    // once for all of them
    constexpr int64_t C = DIM / 16;
    if (G <= 4) {
      __m512 a[4][C];
#pragma GCC unroll 4
      for (int64_t g = 0; g < 4; ++g)
        for (int64_t c = 0; c < C; ++c) a[g][c] = g < G ? _mm512_loadu_ps(acc + g * DIM + 16 * c) : _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const T* row = v + j * vs;
        __m512 x[C];
        for (int64_t c = 0; c < C; ++c) x[c] = load16(row + 16 * c);
#pragma GCC unroll 4
        for (int64_t g = 0; g < 4; ++g) {
          if (g < G) {
            const __m512 w = _mm512_set1_ps(p[g * BLOCK + j]);
            for (int64_t c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(w, x[c], a[g][c]);
          }
        }
      }
#pragma GCC unroll 4
      for (int64_t g = 0; g < 4; ++g)
        if (g < G)
          for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * DIM + 16 * c, a[g][c]);
      return;
    }
  }
  if constexpr (DIM > 0 && DIM % 16 == 0) {
    constexpr int64_t C = DIM / 16;
    for (int64_t g = 0; g < G; ++g) {
      __m512 a[C];
      for (int64_t c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + g * DIM + 16 * c);
      for (int64_t j = 0; j < n; ++j) {
        const __m512 w = _mm512_set1_ps(p[g * BLOCK + j]);
        const T* row = v + j * vs;
        for (int64_t c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(w, load16(row + 16 * c), a[c]);
      }
      for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * DIM + 16 * c, a[c]);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < G; ++g) axpy(p[g * BLOCK + j], v + j * vs, acc + g * D, D);
}

// q [B, Hq, D] fp32 contiguous (bf16 values where k / v are bf16), not scaled: each score is scaled before the mask
// is added; k, v [B, Hkv, S, D] with unit stride along D; mask [B, S] fp32 additive or empty; out [B, Hq, D] fp32.
// DIM: the head dimension as a compile-time constant (0: read at run time), so the per-key loops unroll fully.
template <typename T, int64_t DIM>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scaling,
         at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = k.size(1), S = k.size(2), G = Hq / Hkv;
  const int64_t D = DIM ? DIM : q.size(2);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const float* qp = q.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  const float* mp = mask.numel() ? mask.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t kb = k.stride(0), kh = k.stride(1), ks = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vs = v.stride(2);
  // Each row starts at the block of its first slot the mask lets it read. A batch's rows share one width, so a row
  // whose context is shorter than the longest is padded on the left, and a block of masked slots before every
  // readable one adds exactly nothing: its weights are exp(-huge) = 0 against any later maximum, and the rescale at
  // the first readable block (exp of the old maximum minus the new, 0) clears whatever it had summed. A row with no
  // readable slot reads all of them, as SDPA does.
  std::vector<int64_t> first_block(B, 0);
  if (mp)
    for (int64_t b = 0; b < B; ++b) {
      int64_t j = 0;
      while (j < S && mp[b * S + j] <= -1e30f) ++j;
      first_block[b] = j < S ? j / BLOCK * BLOCK : 0;
    }
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kf(BLOCK * D), p(G * BLOCK), acc(G * D), m(G), l(G);
    std::vector<at::BFloat16> qb(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const float* qg = qp + (b * Hq + h * G) * D;  // the group's G query rows
      if constexpr (std::is_same_v<T, at::BFloat16>)
        for (int64_t i = 0; i < G * D; ++i) qb[i] = static_cast<at::BFloat16>(qg[i]);
      const T* kbase = kp + b * kb + h * kh;
      const T* vbase = vp + b * vb + h * vh;
      const float* mrow = mp ? mp + b * S : nullptr;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t s0 = first_block[b]; s0 < S; s0 += BLOCK) {
        const int64_t n = std::min(BLOCK, S - s0);
        block_scores<T, DIM>(kbase + s0 * ks, ks, n, qg, qb.data(), G, D, kf.data(), p.data());
        for (int64_t g = 0; g < G; ++g) {
          float* __restrict pg = p.data() + g * BLOCK;
          if (mrow)
            for (int64_t j = 0; j < n; ++j) pg[j] = pg[j] * scale + mrow[s0 + j];
          else
            for (int64_t j = 0; j < n; ++j) pg[j] *= scale;
          float top = m[g];
          for (int64_t j = 0; j < n; ++j) top = std::max(top, pg[j]);
          // rescale what was summed under the old maximum (none yet: m = -inf, nothing to scale)
          const float rescale = m[g] == -INFINITY ? 0.f : exp_nonpositive(m[g] - top);
          float sum = 0.f;
          for (int64_t j = 0; j < n; ++j) {
            pg[j] = exp_nonpositive(pg[j] - top);
            sum += pg[j];
          }
          l[g] = l[g] * rescale + sum;
          m[g] = top;
          float* __restrict ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] *= rescale;
        }
        block_values<T, DIM>(vbase + s0 * vs, vs, n, p.data(), G, D, acc.data());
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * Hq + h * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scaling) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "q [B, Hq, D], k / v [B, Hkv, S, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous fp32");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "k and v: one shape, one dtype");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(2) && q.size(1) % k.size(1) == 0, "q / k shapes");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k / v: unit stride along the head dimension");
  TORCH_CHECK(mask.numel() == 0 || (mask.scalar_type() == at::kFloat && mask.is_contiguous() &&
              mask.dim() == 2 && mask.size(0) == k.size(0) && mask.size(1) == k.size(2)), "mask: fp32 [B, S]");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const bool bf16 = k.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || k.scalar_type() == at::kFloat, "k / v: fp32 or bf16");
  switch (q.size(2)) {
    case 64: bf16 ? run<at::BFloat16, 64>(q, k, v, mask, scaling, out) : run<float, 64>(q, k, v, mask, scaling, out); break;
    case 128: bf16 ? run<at::BFloat16, 128>(q, k, v, mask, scaling, out) : run<float, 128>(q, k, v, mask, scaling, out); break;
    default: bf16 ? run<at::BFloat16, 0>(q, k, v, mask, scaling, out) : run<float, 0>(q, k, v, mask, scaling, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_attention", &decode_attention); }
"""


def _cpu_flags() -> str:
    """The whole flags line: ``-march=native`` compiles for every flag, not only those the precision policy reads
    (`models.precision.machine`)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: the machine name stands in
        return os.uname().machine
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def _ninja_on_path() -> None:
    """torch's loader runs ``ninja`` from PATH; a virtual environment's own ninja (the `ninja` wheel) is not on it when
    its python runs without activating it (as ``make test`` does)."""
    try:
        import ninja
    except ImportError:  # a ninja elsewhere on PATH may still serve
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


@functools.cache
def _module(without: tuple[str, ...] = ()):
    """The compiled extension, or None where it cannot be built (logged once). ``without``: instruction-set
    extensions compiled out (``-mno-<name>``, e.g. ``avx512bf16``, ``avx512f``), so the tests run on any host the
    loops that a host lacking them compiles."""
    from torch.utils.cpp_extension import load_inline

    _ninja_on_path()

    key = _SOURCE + _cpu_flags() + torch.__version__ + " ".join(without)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    try:
        return load_inline(
            name=f"drafters_cpu_decode_{digest}",
            cpp_sources=_SOURCE,
            # -fopenmp: at::parallel_for is a header-inlined OpenMP loop, serial when built without it
            extra_cflags=[
                "-O3",
                "-march=native",
                *(f"-mno-{name}" for name in without),
                "-ffast-math",
                "-fno-finite-math-only",
                "-fopenmp",
            ],  # fmt: skip
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, an unsupported flag: the SDPA path stays
        log.warning("the CPU decode-attention kernel could not be built (%s); SDPA serves one-token queries", err)
        return None


def available() -> bool:
    """Whether the kernel is built (building it on first call) and not turned off by `ENV_VAR`."""
    return os.environ.get(ENV_VAR, "1") != "0" and _module() is not None


def one_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """query [B, Hq, 1, D], key / value [B, Hkv, S, D] (unit stride along D; any other strides, e.g. a prefix view
    of a larger buffer), mask None, bool (True = may attend) or additive, [B or 1, 1, 1, S] → [B, Hq, 1, D] in the
    query's dtype. Requires `available()`."""
    B, Hq, _, D = query.shape
    q = query.reshape(B, Hq, D).float().contiguous()  # unscaled: a bf16 query's fp32 copy rounds back exactly
    return _module().decode_attention(q, key, value, _mask_rows(mask, B), scaling).to(query.dtype).unsqueeze(2)


_last_mask: list = [None, None]
"""The last mask seen and its rows: HF hands every layer of a forward the same mask object."""


def _mask_rows(mask: torch.Tensor | None, batch: int) -> torch.Tensor:
    """mask [B or 1, 1, 1, S] (bool: True = may attend; or additive) → the kernel's fp32 additive [B, S] (empty: no
    mask), built once per forward, not once per layer."""
    if mask is None:
        return torch.empty(0)
    if mask is not _last_mask[0]:
        m = mask[:, 0, -1, :]
        m = (
            torch.zeros(m.shape).masked_fill_(~m, torch.finfo(torch.float32).min)
            if m.dtype == torch.bool
            else m.float()
        )
        _last_mask[:] = [mask, m.expand(batch, -1).contiguous()]
    return _last_mask[1]


def _kernel_reads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a call is one the kernel serves (else SDPA does)."""
    return (
        query.shape[2] == 1
        and query.device.type == "cpu"
        and key.dtype in (torch.float32, torch.bfloat16)
        and query.dtype == key.dtype == value.dtype  # a bf16 cache's scores take the query in bf16
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and (mask is None or (mask.dim() == 4 and mask.shape[1] == 1))
        and available()
    )


def _shares_heads(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a call is a masked one of several query rows with grouped key / value heads on the CPU (a verified
    draft): HF's SDPA function copies every cached key and value once per query head of a group for it (`repeat_kv`,
    since CUDA's kernels fall back to the math path on a masked grouped call), where torch's CPU kernel reads the
    grouped heads as they are (``enable_gqa``). SmolLM2's 4-token verify forward in bf16 took 25.2 ms against 27.5
    with the copies (13 tokens 30.3 against 32.5) on the 2-core AMX Xeon; one token keeps HF's own grouping."""
    return (
        query.device.type == "cpu"
        and query.shape[2] > 1
        and mask is not None
        and query.shape[1] != key.shape[1]
        and query.shape[1] % key.shape[1] == 0
        and os.environ.get(ENV_VAR, "1") != "0"
    )


_LACKS = ("sliding_window", "softcap", "s_aux", "position_bias")
"""Model features neither route here implements: a call with one goes to HF's SDPA function."""


def _ours(dropout: float, kwargs: dict) -> bool:
    return not dropout and all(kwargs.get(name) is None for name in _LACKS)


def shared_heads_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """A `_shares_heads` call through torch's SDPA, the key / value heads read as they are; [B, q, Hq, D]."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function form: one-token queries through the kernel, every other call as `verify_attention`
    serves it. Returns [B, q, Hq, D] as HF's attention functions do."""
    if not _ours(dropout, kwargs) or not _kernel_reads(query, key, value, attention_mask):
        return verify_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return one_query_attention(query, key, value, attention_mask, scale).transpose(1, 2), None


def verify_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function form for a served target (`VERIFY_NAME`): masked grouped calls of several query rows
    with the heads shared, every other call (one-token decoding, vanilla's included) HF's SDPA function unchanged."""
    if _ours(dropout, kwargs) and _shares_heads(query, key, attention_mask):
        return shared_heads_attention(query, key, value, attention_mask, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


AttentionInterface.register(NAME, decode_attention)
# HF builds no mask at all for a name its mask interface lacks; every call SDPA serves needs SDPA's.
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionInterface.register(VERIFY_NAME, verify_attention)
AttentionMaskInterface.register(VERIFY_NAME, sdpa_mask)


def serve_shared_heads(model: PreTrainedModel) -> bool:
    """Give a CPU model on SDPA the `VERIFY_NAME` implementation for good (returns whether it did): its draft
    verification then reads grouped key / value heads in place; its one-token forwards stay exactly HF's, so vanilla
    decoding times as before."""
    if model.device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(VERIFY_NAME)
    return True


@contextmanager
def one_pass_decode(model: PreTrainedModel) -> Iterator[bool]:
    """Serve ``model``'s one-token queries by the kernel inside the block (yields whether it does): only for a CPU
    model on SDPA (HF's or `VERIFY_NAME`, restored after the block), and only where the kernel builds."""
    before = model.config._attn_implementation
    if model.device.type != "cpu" or before not in ("sdpa", VERIFY_NAME) or not available():
        yield False
        return
    model.set_attn_implementation(NAME)
    try:
        yield True
    finally:
        model.set_attn_implementation(before)
