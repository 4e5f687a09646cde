// mok_moe_bwd on the CPU: every gradient from dy and the forward's residuals.
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

template <class S, class D>
void Backward(const MoeDims& d, ffi::AnyBuffer dy_buf, const MoeInputs& in,
              const MoeResiduals& res, const MoeBwdResults& out) {
  const int64_t T = d.T, H = d.H, I = d.I, k = d.k, Is = d.Is;
  const D* dy = dy_buf.reinterpret_data<D>();
  const S* x = in.x.reinterpret_data<S>();
  const float* weights = in.weights.reinterpret_data<float>();
  const S *wg = in.w_gate.reinterpret_data<S>(), *wu = in.w_up.reinterpret_data<S>(),
          *wd = in.w_down.reinterpret_data<S>();
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
    const S* wd_e = wd + e * I * H;
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
        float dh = 0.0f;
        for (int64_t h = 0; h < H; ++h) dh += Load(dyr_row[h]) * Load(wd_e[i * H + h]);
        float hv = Silu(g) * u;
        dw_parts[r * parts + i / 128] += dh * hv;
        dh *= w;
        dgu_row[i] = Store<S>(dh * u * SiluGrad(g));
        dgu_row[I + i] = Store<S>(dh * Silu(g));
        h_rec[r * I + i] = Store<S>(w * hv);
        h_row[i] = Load(h_rec[r * I + i]);
      }
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
    const S *wg_e = wg + e * H * I, *wu_e = wu + e * H * I;
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      if (rows[r] < 0) continue;
      const S* dgu_row = dgu + r * 2 * I;
      for (int64_t h = 0; h < H; ++h) {
        float dx = 0.0f;
        for (int64_t i = 0; i < I; ++i) {
          float dg = Load(dgu_row[i]), du = Load(dgu_row[I + i]);
          dx += dg * Load(wg_e[h * I + i]) + du * Load(wu_e[h * I + i]);
        }
        dx_r[r * H + h] = Store<S>(dx);
      }
    }
  }

  // dx[t] = round(sum_j dx_r[pos[t, j]] in j order + the shared expert's part). The shared
  // expert is a dense MLP over all T tokens; its weight gradients sum over t in order.
  const S *wsg = in.ws_gate.reinterpret_data<S>(), *wsu = in.ws_up.reinterpret_data<S>(),
          *wsd = in.ws_down.reinterpret_data<S>();
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
      float dh = 0.0f, a = Load(h_s[t * Is + i]);
      for (int64_t h = 0; h < H; ++h) {
        float dyv = Load(dy[t * H + h]);
        dh += dyv * Load(wsd[i * H + h]);
        sd[i * H + h] += a * dyv;
      }
      dgu_row[i] = Store<S>(dh * u * SiluGrad(g));
      dgu_row[Is + i] = Store<S>(dh * Silu(g));
    }
    for (int64_t h = 0; h < H && Is > 0; ++h) {
      float xv = Load(x[t * H + h]), dxs = 0.0f;
      for (int64_t i = 0; i < Is; ++i) {
        float dg = Load(dgu_row[i]), du = Load(dgu_row[Is + i]);
        dxs += dg * Load(wsg[h * Is + i]) + du * Load(wsu[h * Is + i]);
        sg[h * Is + i] += xv * dg;
        su[h * Is + i] += xv * du;
      }
      dx_s[t * H + h] = Store<S>(dxs);
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
    Backward<float, float>(*dims, dy, in, res, out);
  } else if (dy_f32) {
    Backward<bf16_bits, float>(*dims, dy, in, res, out);
  } else {
    Backward<bf16_bits, bf16_bits>(*dims, dy, in, res, out);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokMoeBwdCpu, mok::cpu::MoeBwd, mok::BindMoeBwd(xla::ffi::Ffi::Bind()));
