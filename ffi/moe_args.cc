#include "moe_args.h"

#include "../cuda/layout_contract.h"

#include <algorithm>
#include <sstream>
#include <vector>

namespace mok {

namespace {

const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::F64: return "f64";
    case ffi::DataType::S32: return "s32";
    case ffi::DataType::S64: return "s64";
    case ffi::DataType::F8E4M3FN: return "f8e4m3fn";
    default: return "dtype";
  }
}

template <class Dims>
std::string Describe(ffi::DataType dtype, const Dims& dims) {
  std::ostringstream s;
  s << DtypeName(dtype) << "[";
  const char* sep = "";
  for (int64_t v : dims) s << sep << v, sep = ", ";
  s << "]";
  return s.str();
}

ffi::Error Invalid(const char* target, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + what);
}

}  // namespace

std::string DescribeBuffer(ffi::DataType dtype, ffi::AnyBuffer::Dimensions dims) {
  return Describe(dtype, dims);
}

int64_t RoutedRows(int64_t routes, int64_t experts, int64_t block_m) {
  return routes + std::min(experts, routes) * (block_m - 1);
}

ffi::Error CheckBuffer(const char* target, const char* name, ffi::AnyBuffer b,
                       ffi::DataType dtype, std::initializer_list<int64_t> shape) {
  auto dims = b.dimensions();
  bool same = b.element_type() == dtype && dims.size() == shape.size() &&
              std::equal(shape.begin(), shape.end(), dims.begin());
  if (same) return ffi::Error::Success();
  return Invalid(target, std::string(name) + " must be " + Describe(dtype, shape) + ", got " +
                             Describe(b.element_type(), dims));
}

ffi::ErrorOr<MoeDims> CheckInputs(const char* target, const MoeInputs& in, int64_t block_m,
                                  bool recompute, int64_t ranks) {
  auto x = in.x.dimensions(), experts = in.experts.dimensions(), wg = in.w_gate.dimensions(),
       wsg = in.ws_gate.dimensions();
  auto dtype = in.x.element_type();
  auto fail = [&](const std::string& what) { return ffi::Unexpected(Invalid(target, what)); };
  if ((dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16) || x.size() != 2)
    return fail("x must be bf16 or f32 (T, H), got " + Describe(dtype, x));
  const std::string H = std::to_string(x[1]);
  if (experts.size() != 2 || experts[0] != x[0] || experts[1] < 1)
    return fail("experts must be (T, k) with T = " + std::to_string(x[0]) + " and k >= 1, got " +
                Describe(in.experts.element_type(), experts));
  if (wg.size() != 3 || wg[1] != x[1] || wg[0] < 1 || wg[2] < 1)
    return fail("w_gate must be (E, H, I) with H = " + H + ", got " +
                Describe(in.w_gate.element_type(), wg));
  if (wsg.size() != 2 || wsg[0] != x[1])
    return fail("ws_gate must be (H, Is) with H = " + H + ", got " +
                Describe(in.ws_gate.element_type(), wsg));
  if (block_m < 1 || block_m > 256 || (block_m & (block_m - 1)))
    return fail("block_m must be a power of two in [1, 256], got " + std::to_string(block_m));
  if (ranks < 1) return fail("ranks must be at least 1, got " + std::to_string(ranks));
  MoeDims d{x[0], x[1], wg[2], wg[0], experts[1], wsg[1], 0, block_m, recompute, ranks};
  d.R = RoutedRows(d.T * d.k, d.E, block_m);
  const ffi::DataType s32 = ffi::DataType::S32, f32 = ffi::DataType::F32;
  for (auto err : {CheckBuffer(target, "experts", in.experts, s32, {d.T, d.k}),
                   CheckBuffer(target, "weights", in.weights, f32, {d.T, d.k}),
                   CheckBuffer(target, "w_gate", in.w_gate, dtype, {d.E, d.H, d.I}),
                   CheckBuffer(target, "w_up", in.w_up, dtype, {d.E, d.H, d.I}),
                   CheckBuffer(target, "w_down", in.w_down, dtype, {d.E, d.I, d.H}),
                   CheckBuffer(target, "ws_gate", in.ws_gate, dtype, {d.H, d.Is}),
                   CheckBuffer(target, "ws_up", in.ws_up, dtype, {d.H, d.Is}),
                   CheckBuffer(target, "ws_down", in.ws_down, dtype, {d.Is, d.H})}) {
    if (err.failure()) return ffi::Unexpected(err);
  }
  return d;
}

namespace {

// A buffer whose rows the mode sets (gu, gu_shared, xs and the forward's xs scratch): a shape
// that belongs to the other mode is most likely residuals of a forward called with another
// `recompute`, so the message says which.
ffi::Error CheckByMode(const char* target, const char* name, ffi::AnyBuffer b,
                       ffi::DataType dtype, int64_t rows, int64_t cols, bool recompute) {
  ffi::Error err = CheckBuffer(target, name, b, dtype, {rows, cols});
  if (err.success()) return err;
  return ffi::Error::InvalidArgument(err.message() + " (recompute = " +
                                     (recompute ? "true" : "false") + ")");
}

ffi::Error CheckResiduals(const char* target, const MoeDims& d, ffi::DataType dtype,
                          const MoeResiduals& r) {
  const ffi::DataType s32 = ffi::DataType::S32;
  const int64_t saved_rows = d.recompute ? 0 : d.R, gu_shared_rows = d.recompute ? 0 : d.T;
  for (auto err : {CheckBuffer(target, "pos", r.pos, s32, {d.T, d.k}),
                   CheckBuffer(target, "offsets", r.offsets, s32, {d.E + 1}),
                   CheckBuffer(target, "rows", r.rows, s32, {d.R}),
                   CheckByMode(target, "gu", r.gu, dtype, saved_rows, 2 * d.I, d.recompute),
                   CheckByMode(target, "gu_shared", r.gu_shared, dtype, gu_shared_rows,
                               2 * d.Is, d.recompute),
                   CheckByMode(target, "xs", r.xs, dtype, saved_rows, d.H, d.recompute)}) {
    if (err.failure()) return err;
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error CheckFwdResults(const MoeDims& d, ffi::DataType dtype, const MoeFwdResults& out) {
  const char* target = "mok_moe_fwd";
  auto ydt = out.y.element_type();
  if (ydt != dtype && ydt != ffi::DataType::F32)
    return Invalid(target, "y must be of x's dtype or f32, got " +
                               Describe(ydt, out.y.dimensions()));
  if (auto err = CheckBuffer(target, "y", out.y, ydt, {d.T, d.H}); err.failure()) return err;
  if (auto err = CheckResiduals(target, d, dtype, out.res); err.failure()) return err;
  for (auto err : {CheckBuffer(target, "y_routed", out.y_routed, dtype, {d.R, d.H}),
                   CheckByMode(target, "xs_scratch", out.xs_scratch, dtype,
                               d.recompute ? d.R : 0, d.H, d.recompute),
                   CheckBuffer(target, "h", out.h, dtype, {d.R, d.I}),
                   CheckBuffer(target, "h_shared", out.h_shared, dtype, {d.T, d.Is}),
                   CheckBuffer(target, "y_shared", out.y_shared, dtype, {d.Is > 0 ? d.T : 0, d.H}),
                   CheckBuffer(target, "layout", out.layout, ffi::DataType::S32,
                               {LayoutScratchInts(d.T, d.k, d.E)})}) {
    if (err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error CheckBwdArgs(const MoeDims& d, ffi::DataType dtype, ffi::AnyBuffer dy,
                        const MoeResiduals& res, const MoeBwdResults& out) {
  const char* target = "mok_moe_bwd";
  auto dydt = dy.element_type();
  if (dydt != dtype && dydt != ffi::DataType::F32)
    return Invalid(target, "dy must be of x's dtype or f32, got " +
                               Describe(dydt, dy.dimensions()));
  if (auto err = CheckBuffer(target, "dy", dy, dydt, {d.T, d.H}); err.failure()) return err;
  if (auto err = CheckResiduals(target, d, dtype, res); err.failure()) return err;
  const ffi::DataType f32 = ffi::DataType::F32;
  for (auto err : {CheckBuffer(target, "dx", out.dx, dtype, {d.T, d.H}),
                   CheckBuffer(target, "dweights", out.dweights, f32, {d.T, d.k}),
                   CheckBuffer(target, "dw_gate", out.dw_gate, dtype, {d.E, d.H, d.I}),
                   CheckBuffer(target, "dw_up", out.dw_up, dtype, {d.E, d.H, d.I}),
                   CheckBuffer(target, "dw_down", out.dw_down, dtype, {d.E, d.I, d.H}),
                   CheckBuffer(target, "dws_gate", out.dws_gate, dtype, {d.H, d.Is}),
                   CheckBuffer(target, "dws_up", out.dws_up, dtype, {d.H, d.Is}),
                   CheckBuffer(target, "dws_down", out.dws_down, dtype, {d.Is, d.H}),
                   CheckBuffer(target, "xs_rows", out.xs_rows, dtype, {d.R, d.H}),
                   CheckBuffer(target, "dy_routed", out.dy_routed, dtype, {d.R, d.H}),
                   CheckBuffer(target, "dgu", out.dgu, dtype, {d.R, 2 * d.I}),
                   CheckBuffer(target, "dgu_shared", out.dgu_shared, dtype, {d.T, 2 * d.Is}),
                   CheckBuffer(target, "h", out.h, dtype, {d.R, d.I}),
                   CheckBuffer(target, "h_shared", out.h_shared, dtype, {d.T, d.Is}),
                   CheckBuffer(target, "dx_shared", out.dx_shared, dtype,
                               {d.Is > 0 ? d.T : 0, d.H}),
                   CheckBuffer(target, "dw_parts", out.dw_parts, f32, {d.R, DwPartCols(d.I)}),
                   CheckBuffer(target, "queue", out.queue, ffi::DataType::S32,
                               {TileQueueInts(d.T, d.k, d.E)})}) {
    if (err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<MoeDims> CheckFp8Call(const char* target, const MoeFp8Inputs& in,
                                   const MoeFwdFp8Results& out, int64_t block_m, int64_t ranks) {
  auto x = in.x.dimensions(), experts = in.experts.dimensions(), wg = in.w_gate.dimensions(),
       wsg = in.ws_gate.dimensions();
  auto fail = [&](const std::string& what) { return ffi::Unexpected(Invalid(target, what)); };
  if (in.x.element_type() != ffi::DataType::BF16 || x.size() != 2)
    return fail("x must be bf16 (T, H), got " + Describe(in.x.element_type(), x));
  if (experts.size() != 2 || experts[0] != x[0] || experts[1] < 1)
    return fail("experts must be (T, k) with T = " + std::to_string(x[0]) + " and k >= 1, got " +
                Describe(in.experts.element_type(), experts));
  if (wg.size() != 3 || wg[2] != x[1] || wg[0] < 1 || wg[1] < 1)
    return fail("w_gate must be (E, I, H) with H = " + std::to_string(x[1]) + ", got " +
                Describe(in.w_gate.element_type(), wg));
  if (wsg.size() != 2 || wsg[1] != x[1])
    return fail("ws_gate must be (Is, H) with H = " + std::to_string(x[1]) + ", got " +
                Describe(in.ws_gate.element_type(), wsg));
  if (block_m < 1 || block_m > 256 || (block_m & (block_m - 1)))
    return fail("block_m must be a power of two in [1, 256], got " + std::to_string(block_m));
  if (ranks < 1) return fail("ranks must be at least 1, got " + std::to_string(ranks));
  MoeDims d{x[0], x[1], wg[1], wg[0], experts[1], wsg[0], 0, block_m, false, ranks};
  if (d.H % 128 || d.I % 128 || d.Is % 128)
    return fail("H, I and Is must be multiples of 128 (the FP8 blocks), got " +
                std::to_string(d.H) + ", " + std::to_string(d.I) + ", " + std::to_string(d.Is));
  d.R = RoutedRows(d.T * d.k, d.E, d.block_m);
  const int64_t hb = d.H / 128, ib = d.I / 128, sb = d.Is / 128;
  const int64_t pitch = Fp8ScalePitch(d.R), shared_rows = d.Is > 0 ? d.T : 0;
  const ffi::DataType f8 = ffi::DataType::F8E4M3FN, f32 = ffi::DataType::F32,
                      s32 = ffi::DataType::S32, bf16 = ffi::DataType::BF16;
  const ffi::DataType ydt = out.y.element_type() == f32 ? f32 : bf16;
  for (auto err : {CheckBuffer(target, "experts", in.experts, s32, {d.T, d.k}),
                   CheckBuffer(target, "weights", in.weights, f32, {d.T, d.k}),
                   CheckBuffer(target, "w_gate", in.w_gate, f8, {d.E, d.I, d.H}),
                   CheckBuffer(target, "w_gate_scale", in.w_gate_scale, f32, {d.E, hb, ib}),
                   CheckBuffer(target, "w_up", in.w_up, f8, {d.E, d.I, d.H}),
                   CheckBuffer(target, "w_up_scale", in.w_up_scale, f32, {d.E, hb, ib}),
                   CheckBuffer(target, "w_down", in.w_down, f8, {d.E, d.H, d.I}),
                   CheckBuffer(target, "w_down_scale", in.w_down_scale, f32, {d.E, ib, hb}),
                   CheckBuffer(target, "ws_gate", in.ws_gate, f8, {d.Is, d.H}),
                   CheckBuffer(target, "ws_gate_scale", in.ws_gate_scale, f32, {hb, sb}),
                   CheckBuffer(target, "ws_up", in.ws_up, f8, {d.Is, d.H}),
                   CheckBuffer(target, "ws_up_scale", in.ws_up_scale, f32, {hb, sb}),
                   CheckBuffer(target, "ws_down", in.ws_down, f8, {d.H, d.Is}),
                   CheckBuffer(target, "ws_down_scale", in.ws_down_scale, f32, {sb, hb}),
                   CheckBuffer(target, "y", out.y, ydt, {d.T, d.H}),
                   CheckBuffer(target, "pos", out.pos, s32, {d.T, d.k}),
                   CheckBuffer(target, "offsets", out.offsets, s32, {d.E + 1}),
                   CheckBuffer(target, "rows", out.rows, s32, {d.R}),
                   CheckBuffer(target, "xq", out.xq, f8, {d.R, d.H}),
                   CheckBuffer(target, "xq_scale", out.xq_scale, f32, {hb, pitch}),
                   CheckBuffer(target, "hq", out.hq, f8, {d.R, d.I}),
                   CheckBuffer(target, "hq_scale", out.hq_scale, f32, {ib, pitch}),
                   CheckBuffer(target, "y_routed", out.y_routed, bf16, {d.R, d.H}),
                   CheckBuffer(target, "xq_shared", out.xq_shared, f8, {shared_rows, d.H}),
                   CheckBuffer(target, "xq_shared_scale", out.xq_shared_scale, f32,
                               {hb, Fp8ScalePitch(shared_rows)}),
                   CheckBuffer(target, "hq_shared", out.hq_shared, f8, {d.T, d.Is}),
                   CheckBuffer(target, "hq_shared_scale", out.hq_shared_scale, f32,
                               {sb, Fp8ScalePitch(d.T)}),
                   CheckBuffer(target, "y_shared", out.y_shared, bf16, {shared_rows, d.H}),
                   CheckBuffer(target, "layout", out.layout, s32,
                               {LayoutScratchInts(d.T, d.k, d.E)})}) {
    if (err.failure()) return ffi::Unexpected(err);
  }
  return d;
}

ffi::Error CheckCudaKernelArgs(const char* target, ffi::AnyBuffer x, int64_t block_m) {
  if (x.element_type() != ffi::DataType::BF16)
    return Invalid(target, "the CUDA kernel takes bf16 tokens, got " +
                               Describe(x.element_type(), x.dimensions()));
  if (block_m != 64 && block_m != 128)
    return Invalid(target,
                   "the CUDA kernel needs block_m = 64 or 128, got " + std::to_string(block_m));
  return ffi::Error::Success();
}

ffi::ErrorOr<CombineDims> CheckCombineArgs(const char* target, ffi::AnyBuffer rows,
                                           ffi::AnyBuffer pos, ffi::AnyBuffer weights,
                                           ffi::AnyBuffer extra, ffi::AnyBuffer out) {
  auto r = rows.dimensions(), p = pos.dimensions();
  auto dtype = rows.element_type();
  auto fail = [&](const std::string& what) { return ffi::Unexpected(Invalid(target, what)); };
  if ((dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16) || r.size() != 2)
    return fail("rows must be bf16 or f32 (N, H), got " + Describe(dtype, r));
  if (pos.element_type() != ffi::DataType::S32 || p.size() != 2)
    return fail("pos must be s32 (T, k), got " + Describe(pos.element_type(), p));
  CombineDims d{r[0], p[0], p[1], r[1], weights.element_count() > 0, extra.element_count() > 0};
  if (auto err = CheckBuffer(target, "weights", weights, ffi::DataType::F32,
                             {d.weighted ? d.T : 0, d.k});
      err.failure())
    return ffi::Unexpected(err);
  if (auto err = CheckBuffer(target, "extra", extra, dtype, {d.extra ? d.T : 0, d.H});
      err.failure())
    return ffi::Unexpected(err);
  auto out_dtype = out.element_type() == ffi::DataType::F32 ? ffi::DataType::F32 : dtype;
  if (auto err = CheckBuffer(target, "out", out, out_dtype, {d.T, d.H}); err.failure())
    return ffi::Unexpected(err);
  return d;
}

}  // namespace mok
