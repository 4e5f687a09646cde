// mok_moe_bwd and mok_moe_bwd_fp8 on the CPU: every gradient from dy and the forward's
// residuals (the FP8 target's data-gradient products in e4m3, Fp8Products).
//
//   dy_r[p]  = dy[t]                           dh' = dy_r @ w_down^T, dh = w[t, j] dh'
//   dweights[t, j] = <dh'[p], h[p]>            (= <dy[t], y_routed[p]>; h = silu(g) u, f32)
//   dg, du   = SwiGLU backward(g, u, dh)       dw_down_e = (w h)_e^T @ dy_r_e
//                                              dw_gate_e = x_e^T @ dg_e, dw_up_e = x_e^T @ du_e
//   dx_r     = dg @ w_gate^T + du @ w_up^T     dx[t] = sum_j dx_r[pos[t, j]] + shared part
//   (dx_r last: it takes the buffer of xs, as on the GPU; each route's dx_r and the shared
//   part are rounded to x's dtype, as each route's output is in the forward, and so is w h;
//   dweights sums each 128 columns of I in dw_parts first, then those in order, as the GPU)
//
// gu = [g | u] comes from the residuals, or with recompute from x first (RecomputeGu).
#include <algorithm>
#include <string>
#include <vector>

#include "../cuda/layout_contract.h"
#include "combine_cpu.h"
#include "cpu_math.h"
#include "moe_args.h"
#include "moe_cpu.h"

namespace mok::cpu {
namespace {

// The layout residuals are addresses: a caller could hand in anything, so check every one
// before it is used.
ffi::Error CheckLayout(const MoeDims& d, const int32_t* experts, const MoeResiduals& res) {
  const int32_t* pos = res.pos.reinterpret_data<int32_t>();
  const int32_t* offsets = res.offsets.reinterpret_data<int32_t>();
  const int32_t* rows = res.rows.reinterpret_data<int32_t>();
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("mok_moe_bwd: residual " + what +
                                       " is not the forward's layout");
  };
  for (int64_t q = 0; q < d.T * d.k; ++q)
    if (pos[q] < -1 || pos[q] >= d.R) return bad("pos");
  if (offsets[0] != 0) return bad("offsets");
  for (int64_t e = 0; e < d.E; ++e)
    if (offsets[e + 1] < offsets[e] || offsets[e + 1] > d.R) return bad("offsets");
  for (int64_t r = 0; r < d.R; ++r) {
    if (rows[r] < -1 || rows[r] >= d.T * d.k) return bad("rows");
    if (rows[r] >= 0 && (experts[rows[r]] < 0 || experts[rows[r]] >= d.E)) return bad("rows");
  }
  return ffi::Error::Success();
}

// gu and gu_shared into dgu and dgu_shared, by the forward's own GateUp on the same rows: the
// bits that the forward would have saved.
template <class S>
void RecomputeGu(const MoeDims& d, const MoeInputs& in, const int32_t* rows,
                 const MoeBwdResults& out) {
  const int64_t H = d.H, I = d.I, Is = d.Is;
  const S* x = in.x.reinterpret_data<S>();
  const int32_t* experts = in.experts.reinterpret_data<int32_t>();
  const S *wg = in.w_gate.reinterpret_data<S>(), *wu = in.w_up.reinterpret_data<S>();
  S* gu = out.dgu.reinterpret_data<S>();
  std::vector<float> g(std::max(I, Is)), u(std::max(I, Is));
  for (int64_t r = 0; r < d.R; ++r) {
    S* gu_row = gu + r * 2 * I;
    if (rows[r] < 0) {
      std::fill(gu_row, gu_row + 2 * I, Store<S>(0.0f));
      continue;
    }
    int64_t e = experts[rows[r]];
    GateUp<S>(H, I, x + rows[r] / d.k * H, wg + e * H * I, wu + e * H * I, gu_row, g.data(),
              u.data());
  }
  const S *wsg = in.ws_gate.reinterpret_data<S>(), *wsu = in.ws_up.reinterpret_data<S>();
  S* gu_s = out.dgu_shared.reinterpret_data<S>();
  for (int64_t t = 0; t < d.T && Is > 0; ++t)
    GateUp<S>(H, Is, x + t * H, wsg, wsu, gu_s + t * 2 * Is, g.data(), u.data());
}

// The data gradients' products of mok_moe_bwd: dh' = dy @ w_down^T and dx = dg @ w_gate^T +
// du @ w_up^T, summed in f32 in order, of a routed row r (expert e) or of the shared expert's
// token t. Rows(r, row) comes first, with each row's dgu once written.
template <class S>
struct ExactProducts {
  const MoeDims& d;
  const S *wg, *wu, *wd, *wsg, *wsu, *wsd;

  ExactProducts(const MoeDims& dims, const MoeInputs& in)
      : d(dims),
        wg(in.w_gate.reinterpret_data<S>()), wu(in.w_up.reinterpret_data<S>()),
        wd(in.w_down.reinterpret_data<S>()), wsg(in.ws_gate.reinterpret_data<S>()),
        wsu(in.ws_up.reinterpret_data<S>()), wsd(in.ws_down.reinterpret_data<S>()) {}
  template <class R>
  float Dh(bool shared, int64_t e, int64_t, int64_t i, const R* dy_row) const {
    const int64_t I = shared ? d.Is : d.I;
    const S* w = shared ? wsd + i * d.H : wd + (e * I + i) * d.H;
    float dh = 0.0f;
    for (int64_t h = 0; h < d.H; ++h) dh += Load(dy_row[h]) * Load(w[h]);
    return dh;
  }
  void Dgu(bool, int64_t, const S*) {}
  float Dx(bool shared, int64_t e, int64_t, int64_t h, const S* dgu_row) const {
    const int64_t I = shared ? d.Is : d.I;
    const S* g = shared ? wsg + h * I : wg + (e * d.H + h) * I;
    const S* u = shared ? wsu + h * I : wu + (e * d.H + h) * I;
    float dx = 0.0f;
    for (int64_t i = 0; i < I; ++i)
      dx += Load(dgu_row[i]) * Load(g[i]) + Load(dgu_row[I + i]) * Load(u[i]);
    return dx;
  }
};

template <class S, class D, class Products>
void Backward(const MoeDims& d, ffi::AnyBuffer dy_buf, const MoeInputs& in,
              const MoeResiduals& res, const MoeBwdResults& out, Products& prod) {
  const int64_t T = d.T, H = d.H, I = d.I, k = d.k, Is = d.Is;
  const D* dy = dy_buf.reinterpret_data<D>();
  const S* x = in.x.reinterpret_data<S>();
  const float* weights = in.weights.reinterpret_data<float>();
  const int32_t* pos = res.pos.reinterpret_data<int32_t>();
  const int32_t* offsets = res.offsets.reinterpret_data<int32_t>();
  const int32_t* rows = res.rows.reinterpret_data<int32_t>();
  if (d.recompute) RecomputeGu<S>(d, in, rows, out);
  // dg | du go over g | u, element by element after reading them: in place where gu is dgu
  // (recompute, or XLA's alias of the residual), else into a buffer of their own.
  const S* gu = (d.recompute ? out.dgu : res.gu).reinterpret_data<S>();
  // out.xs_rows is the GPU's xs (the residual's buffer, without recompute), which these loops
  // read from x instead; it then takes dx_r, as on the GPU.
  S* dy_r = out.dy_routed.reinterpret_data<S>();
  S* dgu = out.dgu.reinterpret_data<S>();
  float* dweights = out.dweights.reinterpret_data<float>();
  float* dw_parts = out.dw_parts.reinterpret_data<float>();
  const int64_t parts = DwPartCols(I);

  S* h_rec = out.h.reinterpret_data<S>();
  // Padding rows hold zeros, so that any reduction over a padded tile sees nothing.
  std::fill(h_rec, h_rec + d.R * I, Store<S>(0.0f));
  std::fill(dy_r, dy_r + d.R * H, Store<S>(0.0f));
  int32_t* queue = out.queue.reinterpret_data<int32_t>();
  std::fill(queue, queue + out.queue.element_count(), 0);  // the CPU GEMMs need no tile queue
  for (int64_t q = 0; q < T * k; ++q) {
    int64_t t = q / k, p = pos[q];
    for (int64_t h = 0; p >= 0 && h < H; ++h) dy_r[p * H + h] = Store<S>(Load(dy[t * H + h]));
  }

  S *dwg = out.dw_gate.reinterpret_data<S>(), *dwu = out.dw_up.reinterpret_data<S>(),
    *dwd = out.dw_down.reinterpret_data<S>();
  std::vector<float> acc_d(I * H), acc_g(H * I), acc_u(H * I), h_row(I);
  for (int64_t e = 0; e < d.E; ++e) {
    std::fill(acc_d.begin(), acc_d.end(), 0.0f);
    std::fill(acc_g.begin(), acc_g.end(), 0.0f);
    std::fill(acc_u.begin(), acc_u.end(), 0.0f);
    // One owner per expert, rows in ascending order: the f32 sums are the same on every run.
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      S* dgu_row = dgu + r * 2 * I;
      if (rows[r] < 0) {
        std::fill(dgu_row, dgu_row + 2 * I, Store<S>(0.0f));
        continue;
      }
      const S* gu_row = gu + r * 2 * I;
      const S* dyr_row = dy_r + r * H;
      const float w = weights[rows[r]];  // the weight of the row's route
      std::fill(dw_parts + r * parts, dw_parts + (r + 1) * parts, 0.0f);
      for (int64_t i = 0; i < I; ++i) {
        float g = Load(gu_row[i]), u = Load(gu_row[I + i]);
        float dh = prod.Dh(false, e, r, i, dyr_row);
        float hv = Silu(g) * u;
        dw_parts[r * parts + i / 128] += dh * hv;
        dh *= w;
        dgu_row[i] = Store<S>(dh * u * SiluGrad(g));
        dgu_row[I + i] = Store<S>(dh * Silu(g));
        h_rec[r * I + i] = Store<S>(w * hv);
        h_row[i] = Load(h_rec[r * I + i]);
      }
      prod.Dgu(false, r, dgu_row);
      const S* x_row = x + rows[r] / k * H;
      for (int64_t h = 0; h < H; ++h) {
        float xv = Load(x_row[h]);
        for (int64_t i = 0; i < I; ++i) {
          acc_g[h * I + i] += xv * Load(dgu_row[i]);
          acc_u[h * I + i] += xv * Load(dgu_row[I + i]);
        }
      }
      for (int64_t i = 0; i < I; ++i)
        for (int64_t h = 0; h < H; ++h) acc_d[i * H + h] += h_row[i] * Load(dyr_row[h]);
    }
    for (int64_t n = 0; n < H * I; ++n) {
      dwg[e * H * I + n] = Store<S>(acc_g[n]);
      dwu[e * H * I + n] = Store<S>(acc_u[n]);
      dwd[e * I * H + n] = Store<S>(acc_d[n]);
    }
  }

  S* dx_r = out.xs_rows.reinterpret_data<S>();
  std::fill(dx_r, dx_r + d.R * H, Store<S>(0.0f));
  for (int64_t e = 0; e < d.E; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      if (rows[r] < 0) continue;
      const S* dgu_row = dgu + r * 2 * I;
      for (int64_t h = 0; h < H; ++h) dx_r[r * H + h] = Store<S>(prod.Dx(false, e, r, h, dgu_row));
    }
  }

  // dx[t] = round(sum_j dx_r[pos[t, j]] in j order + the shared expert's part). The shared
  // expert is a dense MLP over all T tokens; its weight gradients sum over t in order.
  const S* gu_s = (d.recompute ? out.dgu_shared : res.gu_shared).reinterpret_data<S>();
  S* dgu_s = out.dgu_shared.reinterpret_data<S>();
  S* h_s = out.h_shared.reinterpret_data<S>();
  S* dx_s = out.dx_shared.reinterpret_data<S>();
  S* dx = out.dx.reinterpret_data<S>();
  std::vector<float> sd(Is * H, 0.0f), sg(H * Is, 0.0f), su(H * Is, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      int64_t p = pos[t * k + j];
      float dw = 0.0f;
      for (int64_t b = 0; p >= 0 && b < parts; ++b) dw += dw_parts[p * parts + b];
      dweights[t * k + j] = dw;
    }
    const S* gu_row = gu_s + t * 2 * Is;
    S* dgu_row = dgu_s + t * 2 * Is;
    for (int64_t i = 0; i < Is; ++i) {
      float g = Load(gu_row[i]), u = Load(gu_row[Is + i]);
      h_s[t * Is + i] = Store<S>(Silu(g) * u);
      float dh = prod.Dh(true, 0, t, i, dy + t * H), a = Load(h_s[t * Is + i]);
      for (int64_t h = 0; h < H; ++h) sd[i * H + h] += a * Load(dy[t * H + h]);
      dgu_row[i] = Store<S>(dh * u * SiluGrad(g));
      dgu_row[Is + i] = Store<S>(dh * Silu(g));
    }
    if (Is > 0) prod.Dgu(true, t, dgu_row);
    for (int64_t h = 0; h < H && Is > 0; ++h) {
      float xv = Load(x[t * H + h]);
      for (int64_t i = 0; i < Is; ++i) {
        sg[h * Is + i] += xv * Load(dgu_row[i]);
        su[h * Is + i] += xv * Load(dgu_row[Is + i]);
      }
      dx_s[t * H + h] = Store<S>(prod.Dx(true, 0, t, h, dgu_row));
    }
  }
  CombineRows<S, S>(T, k, H, dx_r, pos, nullptr, Is > 0 ? dx_s : nullptr, dx);
  S *dwsg = out.dws_gate.reinterpret_data<S>(), *dwsu = out.dws_up.reinterpret_data<S>(),
    *dwsd = out.dws_down.reinterpret_data<S>();
  for (int64_t n = 0; n < H * Is; ++n) {
    dwsg[n] = Store<S>(sg[n]);
    dwsu[n] = Store<S>(su[n]);
    dwsd[n] = Store<S>(sd[n]);
  }
}

ffi::Error MoeBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer experts,
                  ffi::AnyBuffer weights, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                  ffi::AnyBuffer w_down, ffi::AnyBuffer ws_gate, ffi::AnyBuffer ws_up,
                  ffi::AnyBuffer ws_down, ffi::AnyBuffer pos, ffi::AnyBuffer offsets,
                  ffi::AnyBuffer rows, ffi::AnyBuffer gu, ffi::AnyBuffer gu_shared,
                  ffi::AnyBuffer xs, ffi::Result<ffi::AnyBuffer> dx,
                  ffi::Result<ffi::AnyBuffer> dweights, ffi::Result<ffi::AnyBuffer> dw_gate,
                  ffi::Result<ffi::AnyBuffer> dw_up, ffi::Result<ffi::AnyBuffer> dw_down,
                  ffi::Result<ffi::AnyBuffer> dws_gate, ffi::Result<ffi::AnyBuffer> dws_up,
                  ffi::Result<ffi::AnyBuffer> dws_down, ffi::Result<ffi::AnyBuffer> xs_rows,
                  ffi::Result<ffi::AnyBuffer> dy_routed, ffi::Result<ffi::AnyBuffer> dgu,
                  ffi::Result<ffi::AnyBuffer> dgu_shared, ffi::Result<ffi::AnyBuffer> h,
                  ffi::Result<ffi::AnyBuffer> h_shared, ffi::Result<ffi::AnyBuffer> dx_shared,
                  ffi::Result<ffi::AnyBuffer> dw_parts, ffi::Result<ffi::AnyBuffer> queue,
                  int64_t block_m, bool recompute,
                  int64_t ranks) {
  MoeInputs in{x, experts, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down};
  MoeResiduals res{pos, offsets, rows, gu, gu_shared, xs};
  MoeBwdResults out{*dx,       *dweights, *dw_gate, *dw_up,  *dw_down,   *dws_gate,
                    *dws_up,   *dws_down, *xs_rows, *dy_routed, *dgu, *dgu_shared,
                    *h,        *h_shared, *dx_shared, *dw_parts, *queue};
  auto dims = CheckBwdCall(Platform::kCpu, dy, in, res, out, block_m, recompute, ranks);
  if (dims.has_error()) return dims.error();
  if (auto err = CheckLayout(*dims, experts.reinterpret_data<int32_t>(), res); err.failure())
    return err;
  bool dy_f32 = dy.element_type() == ffi::DataType::F32;
  if (x.element_type() == ffi::DataType::F32) {
    ExactProducts<float> prod(*dims, in);
    Backward<float, float>(*dims, dy, in, res, out, prod);
  } else if (dy_f32) {
    ExactProducts<bf16_bits> prod(*dims, in);
    Backward<bf16_bits, float>(*dims, dy, in, res, out, prod);
  } else {
    ExactProducts<bf16_bits> prod(*dims, in);
    Backward<bf16_bits, bf16_bits>(*dims, dy, in, res, out, prod);
  }
  return ffi::Error::Success();
}

// mok_moe_bwd_fp8's products: dy and dgu in e4m3 (1 x 128 blocks along H and 2I, as the GPU
// quantizes them: dy as it gathers it, each dgu row once written) times the weights' e4m3
// blocks as they are, promoted every 128 of K (Fp8Dot): dx's sum runs over dg's blocks, then
// du's.
struct Fp8Products {
  const MoeDims& d;
  const uint8_t *wg, *wu, *wd, *wsg, *wsu, *wsd;
  const float *sg, *su, *sd, *ssg, *ssu, *ssd;
  uint8_t *dyq, *dyq_shared, *dguq, *dguq_shared;
  float *dyq_scale, *dyq_shared_scale, *dguq_scale, *dguq_shared_scale;
  int64_t pitch, token_pitch;
  std::vector<float> row;

  Fp8Products(const MoeDims& dims, const MoeFp8Inputs& in, const MoeFp8Residuals& res,
              const MoeBwdFp8Scratch& q, const bf16_bits* dy)
      : d(dims),
        wg(u8(in.w_gate)), wu(u8(in.w_up)), wd(u8(in.w_down)), wsg(u8(in.ws_gate)),
        wsu(u8(in.ws_up)), wsd(u8(in.ws_down)), sg(f32(in.w_gate_scale)),
        su(f32(in.w_up_scale)), sd(f32(in.w_down_scale)), ssg(f32(in.ws_gate_scale)),
        ssu(f32(in.ws_up_scale)), ssd(f32(in.ws_down_scale)), dyq(u8(q.dyq)),
        dyq_shared(u8(q.dyq_shared)), dguq(u8(q.dguq)), dguq_shared(u8(q.dguq_shared)),
        dyq_scale(f32(q.dyq_scale)), dyq_shared_scale(f32(q.dyq_shared_scale)),
        dguq_scale(f32(q.dguq_scale)), dguq_shared_scale(f32(q.dguq_shared_scale)),
        pitch(Fp8ScalePitch(dims.R)), token_pitch(Fp8ScalePitch(dims.T)),
        row(2 * std::max({dims.H, dims.I, dims.Is})) {
    const int32_t* pos = res.pos.reinterpret_data<int32_t>();
    const int32_t* rows = res.rows.reinterpret_data<int32_t>();
    const int64_t H = d.H;
    for (int64_t r = 0; r < d.R; ++r) {  // padding rows: zeros with scale 1
      if (rows[r] >= 0) continue;
      std::fill(dyq + r * H, dyq + (r + 1) * H, uint8_t{0});
      for (int64_t b = 0; b < H / 128; ++b) dyq_scale[b * pitch + r] = 1.0f;
    }
    for (int64_t t = 0; t < d.T; ++t) {
      for (int64_t h = 0; h < H; ++h) row[h] = Load(dy[t * H + h]);
      for (int64_t j = 0; j < d.k; ++j) {
        const int64_t p = pos[t * d.k + j];
        if (p >= 0) QuantizeRow(H, row.data(), dyq + p * H, dyq_scale + p, pitch);
      }
      if (d.Is > 0)
        QuantizeRow(H, row.data(), dyq_shared + t * H, dyq_shared_scale + t, token_pitch);
    }
  }
  static uint8_t* u8(ffi::AnyBuffer b) { return b.reinterpret_data<uint8_t>(); }
  static float* f32(ffi::AnyBuffer b) { return b.reinterpret_data<float>(); }

  float Dh(bool shared, int64_t e, int64_t r, int64_t i, const bf16_bits*) const {
    const int64_t I = shared ? d.Is : d.I, hb = d.H / 128;
    if (shared)
      return Fp8Dot(0.0f, d.H, dyq_shared + r * d.H, dyq_shared_scale + r, token_pitch,
                    wsd + i * d.H, ssd + i / 128 * hb, 1);
    return Fp8Dot(0.0f, d.H, dyq + r * d.H, dyq_scale + r, pitch, wd + (e * I + i) * d.H,
                  sd + (e * (I / 128) + i / 128) * hb, 1);
  }
  void Dgu(bool shared, int64_t r, const bf16_bits* dgu_row) {
    const int64_t n = 2 * (shared ? d.Is : d.I);
    for (int64_t c = 0; c < n; ++c) row[c] = Load(dgu_row[c]);
    if (shared) QuantizeRow(n, row.data(), dguq_shared + r * n, dguq_shared_scale + r, token_pitch);
    else QuantizeRow(n, row.data(), dguq + r * n, dguq_scale + r, pitch);
  }
  float Dx(bool shared, int64_t e, int64_t r, int64_t h, const bf16_bits*) const {
    const int64_t I = shared ? d.Is : d.I, ib = I / 128;
    const uint8_t* a = (shared ? dguq_shared : dguq) + r * 2 * I;
    const float* a_scale = (shared ? dguq_shared_scale : dguq_scale) + r;
    const int64_t a_pitch = shared ? token_pitch : pitch;
    const int64_t w_at = shared ? h * I : (e * d.H + h) * I;
    const int64_t s_at = shared ? h / 128 * ib : (e * (d.H / 128) + h / 128) * ib;
    float dx = Fp8Dot(0.0f, I, a, a_scale, a_pitch, (shared ? wsg : wg) + w_at,
                      (shared ? ssg : sg) + s_at, 1);
    return Fp8Dot(dx, I, a + I, a_scale + ib * a_pitch, a_pitch, (shared ? wsu : wu) + w_at,
                  (shared ? ssu : su) + s_at, 1);
  }
};

using Buf = ffi::AnyBuffer;
using Out = ffi::Result<ffi::AnyBuffer>;

ffi::Error MoeBwdFp8(Buf dy, Buf x, Buf experts, Buf weights, Buf w_gate, Buf w_gate_scale,
                     Buf w_up, Buf w_up_scale, Buf w_down, Buf w_down_scale, Buf ws_gate,
                     Buf ws_gate_scale, Buf ws_up, Buf ws_up_scale, Buf ws_down,
                     Buf ws_down_scale, Buf pos, Buf offsets, Buf rows, Buf gu, Buf gu_shared,
                     Out dx, Out dweights, Out dw_gate, Out dw_up, Out dw_down, Out dws_gate,
                     Out dws_up, Out dws_down, Out xs_rows, Out dy_routed, Out dgu,
                     Out dgu_shared, Out h, Out h_shared, Out dx_shared, Out dw_parts,
                     Out queue, Out dyq, Out dyq_scale, Out dyq_shared, Out dyq_shared_scale,
                     Out dguq, Out dguq_scale, Out dguq_shared, Out dguq_shared_scale,
                     int64_t block_m, int64_t ranks) {
  MoeFp8Inputs in{x,      experts,      weights,     w_gate,  w_gate_scale,
                  w_up,   w_up_scale,   w_down,      w_down_scale, ws_gate,
                  ws_gate_scale, ws_up, ws_up_scale, ws_down, ws_down_scale};
  MoeFp8Residuals res{pos, offsets, rows, gu, gu_shared};
  MoeBwdResults out{*dx,       *dweights, *dw_gate, *dw_up,  *dw_down,   *dws_gate,
                    *dws_up,   *dws_down, *xs_rows, *dy_routed, *dgu, *dgu_shared,
                    *h,        *h_shared, *dx_shared, *dw_parts, *queue};
  MoeBwdFp8Scratch q{*dyq,  *dyq_scale,  *dyq_shared,  *dyq_shared_scale,
                     *dguq, *dguq_scale, *dguq_shared, *dguq_shared_scale};
  auto dims = CheckBwdFp8Call(Platform::kCpu, dy, in, res, out, q, block_m, ranks);
  if (dims.has_error()) return dims.error();
  // Backward reads x, weights, the layout and gu of these (never xs: it reads x).
  const MoeInputs bf16_in{x, experts, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down};
  const MoeResiduals bf16_res{pos, offsets, rows, gu, gu_shared, gu};
  if (auto err = CheckLayout(*dims, experts.reinterpret_data<int32_t>(), bf16_res);
      err.failure())
    return err;
  Fp8Products prod(*dims, in, res, q, dy.reinterpret_data<bf16_bits>());
  Backward<bf16_bits, bf16_bits>(*dims, dy, bf16_in, bf16_res, out, prod);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokMoeBwdCpu, mok::cpu::MoeBwd, mok::BindMoeBwd(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MokMoeBwdFp8Cpu, mok::cpu::MoeBwdFp8,
                              mok::BindMoeBwdFp8(xla::ffi::Ffi::Bind()));
