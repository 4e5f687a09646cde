// mok_moe_fwd and mok_moe_fwd_fp8 on the CPU: layout, expert MLPs, weighted combine, shared
// expert.
#include <algorithm>
#include <vector>

#include "../cuda/layout_contract.h"
#include "combine_cpu.h"
#include "cpu_math.h"
#include "moe_args.h"
#include "moe_cpu.h"

namespace mok::cpu {
namespace {

// Histogram of valid routes per expert, offsets padded to block_m, and positions in ascending
// (t, j) order within each expert: the layout the CUDA layout kernel produces.
void Layout(const MoeDims& d, const int32_t* experts, int32_t* pos, int32_t* offsets,
            int32_t* rows) {
  const int64_t routes = d.T * d.k;
  std::vector<int64_t> next(d.E, 0);
  for (int64_t q = 0; q < routes; ++q) {
    int32_t e = experts[q];
    if (e >= 0 && e < d.E) ++next[e];
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < d.E; ++e) {
    int64_t padded = (next[e] + d.block_m - 1) / d.block_m * d.block_m;
    next[e] = offsets[e];
    offsets[e + 1] = int32_t(offsets[e] + padded);
  }
  std::fill(rows, rows + d.R, -1);
  for (int64_t q = 0; q < routes; ++q) {
    int32_t e = experts[q];
    bool valid = e >= 0 && e < d.E;
    pos[q] = valid ? int32_t(next[e]++) : -1;
    if (valid) rows[pos[q]] = int32_t(q);
  }
}

// One token row through an expert MLP, with the kernels' rounding points: gu_row = [g | u]
// and h_row = silu(g) * u (from the f32 g, u) rounded to S; y_row = h @ w_down rounded to S.
template <class S>
void ExpertMlp(int64_t H, int64_t I, const S* x_row, const S* wg, const S* wu, const S* wd,
               S* gu_row, S* h_row, S* y_row, std::vector<float>& g, std::vector<float>& u,
               std::vector<float>& acc) {
  GateUp<S>(H, I, x_row, wg, wu, gu_row, g.data(), u.data());
  std::fill(acc.begin(), acc.end(), 0.0f);
  for (int64_t i = 0; i < I; ++i) {
    h_row[i] = Store<S>(Silu(g[i]) * u[i]);
    float a = Load(h_row[i]);
    for (int64_t h = 0; h < H; ++h) acc[h] += a * Load(wd[i * H + h]);
  }
  for (int64_t h = 0; h < H; ++h) y_row[h] = Store<S>(acc[h]);
}

template <class S, class Y>
void Forward(const MoeDims& d, const MoeInputs& in, const MoeFwdResults& out) {
  const int64_t T = d.T, H = d.H, I = d.I, k = d.k, Is = d.Is;
  const S* x = in.x.reinterpret_data<S>();
  const int32_t* experts = in.experts.reinterpret_data<int32_t>();
  const float* weights = in.weights.reinterpret_data<float>();
  const S *wg = in.w_gate.reinterpret_data<S>(), *wu = in.w_up.reinterpret_data<S>(),
          *wd = in.w_down.reinterpret_data<S>();
  int32_t* pos = out.res.pos.reinterpret_data<int32_t>();
  int32_t* rows = out.res.rows.reinterpret_data<int32_t>();
  // With recompute gu is not kept: each row's gu goes to gu_local, overwritten by the next
  // (GateUp needs somewhere to round it to; h comes from the f32 g, u, so y has the same bits).
  S* gu = d.recompute ? nullptr : out.res.gu.reinterpret_data<S>();
  std::vector<S> gu_local(d.recompute ? 2 * std::max(I, Is) : 0);
  S* y_routed = out.y_routed.reinterpret_data<S>();
  S* xs = (d.recompute ? out.xs_scratch : out.res.xs).reinterpret_data<S>();
  S* h = out.h.reinterpret_data<S>();
  Y* y = out.y.reinterpret_data<Y>();

  Layout(d, experts, pos, out.res.offsets.reinterpret_data<int32_t>(), rows);
  int32_t* layout = out.layout.reinterpret_data<int32_t>();
  std::fill(layout, layout + out.layout.element_count(), 0);  // the CPU layout needs no scratch
  std::vector<float> g(std::max(I, Is)), u(std::max(I, Is)), acc(H);
  for (int64_t r = 0; r < d.R; ++r) {
    S *xs_row = xs + r * H, *gu_row = gu ? gu + r * 2 * I : gu_local.data(), *h_row = h + r * I,
      *yr_row = y_routed + r * H;
    if (rows[r] < 0) {  // padding: zeros, as the GPU's zero-filled rows give
      std::fill(xs_row, xs_row + H, Store<S>(0.0f));
      if (gu) std::fill(gu_row, gu_row + 2 * I, Store<S>(0.0f));
      std::fill(h_row, h_row + I, Store<S>(0.0f));
      std::fill(yr_row, yr_row + H, Store<S>(0.0f));
      continue;
    }
    int64_t t = rows[r] / k, e = experts[rows[r]];
    std::copy(x + t * H, x + (t + 1) * H, xs_row);
    ExpertMlp<S>(H, I, xs_row, wg + e * H * I, wu + e * H * I, wd + e * I * H, gu_row, h_row,
                 yr_row, g, u, acc);
  }
  const S *wsg = in.ws_gate.reinterpret_data<S>(), *wsu = in.ws_up.reinterpret_data<S>(),
          *wsd = in.ws_down.reinterpret_data<S>();
  S* gu_shared = d.recompute ? nullptr : out.res.gu_shared.reinterpret_data<S>();
  S* h_shared = out.h_shared.reinterpret_data<S>();
  S* y_shared = out.y_shared.reinterpret_data<S>();
  for (int64_t t = 0; t < T && Is > 0; ++t) {
    S* gu_row = gu_shared ? gu_shared + t * 2 * Is : gu_local.data();
    ExpertMlp<S>(H, Is, x + t * H, wsg, wsu, wsd, gu_row, h_shared + t * Is, y_shared + t * H, g,
                 u, acc);
  }
  // The k routes in j order, then the shared expert's output (rounded like a route's).
  CombineRows<S, Y>(T, k, H, y_routed, pos, weights, Is > 0 ? y_shared : nullptr, y);
}

ffi::Error MoeFwd(ffi::AnyBuffer x, ffi::AnyBuffer experts, ffi::AnyBuffer weights,
                  ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                  ffi::AnyBuffer ws_gate, ffi::AnyBuffer ws_up, ffi::AnyBuffer ws_down,
                  ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> pos,
                  ffi::Result<ffi::AnyBuffer> offsets, ffi::Result<ffi::AnyBuffer> rows,
                  ffi::Result<ffi::AnyBuffer> gu, ffi::Result<ffi::AnyBuffer> gu_shared,
                  ffi::Result<ffi::AnyBuffer> xs, ffi::Result<ffi::AnyBuffer> y_routed,
                  ffi::Result<ffi::AnyBuffer> xs_scratch, ffi::Result<ffi::AnyBuffer> h,
                  ffi::Result<ffi::AnyBuffer> h_shared, ffi::Result<ffi::AnyBuffer> y_shared,
                  ffi::Result<ffi::AnyBuffer> layout,
                  int64_t block_m, bool recompute, int64_t ranks) {
  MoeInputs in{x, experts, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down};
  MoeFwdResults out{*y,          {*pos, *offsets, *rows, *gu, *gu_shared, *xs},
                    *y_routed,   *xs_scratch, *h, *h_shared, *y_shared, *layout};
  auto dims = CheckFwdCall(Platform::kCpu, in, out, block_m, recompute, ranks);
  if (dims.has_error()) return dims.error();
  bool y_f32 = out.y.element_type() == ffi::DataType::F32;
  if (x.element_type() == ffi::DataType::F32) {
    Forward<float, float>(*dims, in, out);
  } else if (y_f32) {
    Forward<bf16_bits, float>(*dims, in, out);
  } else {
    Forward<bf16_bits, bf16_bits>(*dims, in, out);
  }
  return ffi::Error::Success();
}

// out[n] = Fp8Dot of a (K) with row n of b (N, K), a weight transposed, whose scales are
// b_scale[kb * N / 128 + n / 128] (the weight's as it is).
void Fp8Product(int64_t K, int64_t N, const uint8_t* a, const float* a_scale, int64_t a_pitch,
                const uint8_t* b, const float* b_scale, float* out) {
  for (int64_t n = 0; n < N; ++n)
    out[n] = Fp8Dot(0.0f, K, a, a_scale, a_pitch, b + n * K, b_scale + n / 128, N / 128);
}

// The weights of one FP8 MLP: e4m3 transposed, (I, H), (I, H), (H, I), with their block scales.
struct Fp8Weights {
  const uint8_t *gate, *up, *down;
  const float *gate_scale, *up_scale, *down_scale;
};

// One quantized row (xq_row with scales at xq_scale, pitch apart) through an FP8 MLP: gu_row
// (unless null) [g | u] rounded to bf16, hq_row and its scales, y_row = hq @ w_down rounded to
// bf16.
void Fp8Mlp(int64_t H, int64_t I, const uint8_t* xq_row, const float* xq_scale,
            int64_t xq_pitch, const Fp8Weights& w, bf16_bits* gu_row, uint8_t* hq_row,
            float* hq_scale, int64_t hq_pitch, bf16_bits* y_row, std::vector<float>& g,
            std::vector<float>& u, std::vector<float>& acc) {
  Fp8Product(H, I, xq_row, xq_scale, xq_pitch, w.gate, w.gate_scale, g.data());
  Fp8Product(H, I, xq_row, xq_scale, xq_pitch, w.up, w.up_scale, u.data());
  for (int64_t i = 0; i < I && gu_row; ++i) {
    gu_row[i] = Store<bf16_bits>(g[i]);
    gu_row[I + i] = Store<bf16_bits>(u[i]);
  }
  for (int64_t i = 0; i < I; ++i) g[i] = Silu(g[i]) * u[i];
  QuantizeRow(I, g.data(), hq_row, hq_scale, hq_pitch);
  Fp8Product(I, H, hq_row, hq_scale, hq_pitch, w.down, w.down_scale, acc.data());
  for (int64_t h = 0; h < H; ++h) y_row[h] = Store<bf16_bits>(acc[h]);
}

// A row of zeros with scale 1 in every block: a padding row's xq or hq.
void ZeroRow(int64_t n, uint8_t* q, float* scale, int64_t pitch) {
  std::fill(q, q + n, uint8_t{0});
  for (int64_t b = 0; b < n / 128; ++b) scale[b * pitch] = 1.0f;
}

template <class Y>
void ForwardFp8(const MoeDims& d, const MoeFp8Inputs& in, const MoeFwdFp8Results& out) {
  const int64_t T = d.T, H = d.H, I = d.I, k = d.k, Is = d.Is;
  const bf16_bits* x = in.x.reinterpret_data<bf16_bits>();
  const int32_t* experts = in.experts.reinterpret_data<int32_t>();
  const float* weights = in.weights.reinterpret_data<float>();
  auto u8 = [](ffi::AnyBuffer b) { return b.reinterpret_data<uint8_t>(); };
  auto f32 = [](ffi::AnyBuffer b) { return b.reinterpret_data<float>(); };
  int32_t* pos = out.pos.reinterpret_data<int32_t>();
  int32_t* rows = out.rows.reinterpret_data<int32_t>();
  Layout(d, experts, pos, out.offsets.reinterpret_data<int32_t>(), rows);
  int32_t* layout = out.layout.reinterpret_data<int32_t>();
  std::fill(layout, layout + out.layout.element_count(), 0);  // the CPU layout needs no scratch
  const int64_t pitch = Fp8ScalePitch(d.R), shared_pitch = Fp8ScalePitch(T);
  uint8_t *xq = u8(out.xq), *hq = u8(out.hq);
  float *xq_scale = f32(out.xq_scale), *hq_scale = f32(out.hq_scale);
  bf16_bits* y_routed = out.y_routed.reinterpret_data<bf16_bits>();
  // gu kept (not recompute): each routed row's [g | u], zeros for padding rows.
  bf16_bits* gu = d.recompute ? nullptr : out.gu.reinterpret_data<bf16_bits>();
  bf16_bits* gu_shared = d.recompute ? nullptr : out.gu_shared.reinterpret_data<bf16_bits>();
  std::vector<float> xrow(H), g(std::max(I, Is)), u(std::max(I, Is)), acc(H);
  for (int64_t r = 0; r < d.R; ++r) {
    uint8_t *xq_row = xq + r * H, *hq_row = hq + r * I;
    bf16_bits* yr_row = y_routed + r * H;
    if (rows[r] < 0) {  // padding: zeros with scale 1, as the GPU's gather writes them
      ZeroRow(H, xq_row, xq_scale + r, pitch);
      ZeroRow(I, hq_row, hq_scale + r, pitch);
      std::fill(yr_row, yr_row + H, Store<bf16_bits>(0.0f));
      if (gu) std::fill(gu + r * 2 * I, gu + (r + 1) * 2 * I, Store<bf16_bits>(0.0f));
      continue;
    }
    const int64_t t = rows[r] / k, e = experts[rows[r]];
    for (int64_t h = 0; h < H; ++h) xrow[h] = Load(x[t * H + h]);
    QuantizeRow(H, xrow.data(), xq_row, xq_scale + r, pitch);
    const Fp8Weights w{u8(in.w_gate) + e * I * H, u8(in.w_up) + e * I * H,
                       u8(in.w_down) + e * H * I, f32(in.w_gate_scale) + e * H * I / 16384,
                       f32(in.w_up_scale) + e * H * I / 16384,
                       f32(in.w_down_scale) + e * H * I / 16384};
    Fp8Mlp(H, I, xq_row, xq_scale + r, pitch, w, gu ? gu + r * 2 * I : nullptr, hq_row,
           hq_scale + r, pitch, yr_row, g, u, acc);
  }
  bf16_bits* y_shared = out.y_shared.reinterpret_data<bf16_bits>();
  const Fp8Weights ws{u8(in.ws_gate), u8(in.ws_up), u8(in.ws_down), f32(in.ws_gate_scale),
                      f32(in.ws_up_scale), f32(in.ws_down_scale)};
  for (int64_t t = 0; t < T && Is > 0; ++t) {
    for (int64_t h = 0; h < H; ++h) xrow[h] = Load(x[t * H + h]);
    uint8_t* xq_row = u8(out.xq_shared) + t * H;
    float* xs_scale = f32(out.xq_shared_scale) + t;
    QuantizeRow(H, xrow.data(), xq_row, xs_scale, shared_pitch);
    Fp8Mlp(H, Is, xq_row, xs_scale, shared_pitch, ws,
           gu_shared ? gu_shared + t * 2 * Is : nullptr, u8(out.hq_shared) + t * Is,
           f32(out.hq_shared_scale) + t, shared_pitch, y_shared + t * H, g, u, acc);
  }
  CombineRows<bf16_bits, Y>(T, k, H, y_routed, pos, weights, Is > 0 ? y_shared : nullptr,
                            out.y.reinterpret_data<Y>());
}

ffi::Error MoeFwdFp8(ffi::AnyBuffer x, ffi::AnyBuffer experts, ffi::AnyBuffer weights,
                     ffi::AnyBuffer w_gate, ffi::AnyBuffer w_gate_scale, ffi::AnyBuffer w_up,
                     ffi::AnyBuffer w_up_scale, ffi::AnyBuffer w_down,
                     ffi::AnyBuffer w_down_scale, ffi::AnyBuffer ws_gate,
                     ffi::AnyBuffer ws_gate_scale, ffi::AnyBuffer ws_up,
                     ffi::AnyBuffer ws_up_scale, ffi::AnyBuffer ws_down,
                     ffi::AnyBuffer ws_down_scale, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::AnyBuffer> pos, ffi::Result<ffi::AnyBuffer> offsets,
                     ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> gu,
                     ffi::Result<ffi::AnyBuffer> gu_shared, ffi::Result<ffi::AnyBuffer> xq,
                     ffi::Result<ffi::AnyBuffer> xq_scale, ffi::Result<ffi::AnyBuffer> hq,
                     ffi::Result<ffi::AnyBuffer> hq_scale, ffi::Result<ffi::AnyBuffer> y_routed,
                     ffi::Result<ffi::AnyBuffer> xq_shared,
                     ffi::Result<ffi::AnyBuffer> xq_shared_scale,
                     ffi::Result<ffi::AnyBuffer> hq_shared,
                     ffi::Result<ffi::AnyBuffer> hq_shared_scale,
                     ffi::Result<ffi::AnyBuffer> y_shared, ffi::Result<ffi::AnyBuffer> layout,
                     int64_t block_m, int64_t ranks) {
  MoeFp8Inputs in{x,      experts,      weights,     w_gate,  w_gate_scale,
                  w_up,   w_up_scale,   w_down,      w_down_scale, ws_gate,
                  ws_gate_scale, ws_up, ws_up_scale, ws_down, ws_down_scale};
  MoeFwdFp8Results out{*y,         *pos,       *offsets,         *rows,      *gu, *gu_shared, *xq,
                       *xq_scale,  *hq,        *hq_scale,        *y_routed,  *xq_shared,
                       *xq_shared_scale, *hq_shared, *hq_shared_scale, *y_shared, *layout};
  auto dims = CheckFp8Call(Platform::kCpu, in, out, block_m, ranks);
  if (dims.has_error()) return dims.error();
  if (out.y.element_type() == ffi::DataType::F32) {
    ForwardFp8<float>(*dims, in, out);
  } else {
    ForwardFp8<bf16_bits>(*dims, in, out);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokMoeFwdCpu, mok::cpu::MoeFwd, mok::BindMoeFwd(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MokMoeFwdFp8Cpu, mok::cpu::MoeFwdFp8,
                              mok::BindMoeFwdFp8(xla::ffi::Ffi::Bind()));
