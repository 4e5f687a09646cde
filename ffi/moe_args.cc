#include "moe_args.h"

#include "../cuda/layout_contract.h"

#include <algorithm>
#include <string>
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

// Plain std::string, no iostreams: with a std::ostringstream here, every message that named a
// buffer segfaulted the process under jaxlib 0.11.2, on the CPU and the CUDA targets alike
// (tests/test_ffi_platforms.py), while messages without one were raised.
template <class Dims>
std::string Describe(ffi::DataType dtype, const Dims& dims) {
  std::string s = std::string(DtypeName(dtype)) + "[";
  const char* sep = "";
  for (int64_t v : dims) s += sep + std::to_string(v), sep = ", ";
  return s + "]";
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

namespace {

// experts (T, k) with x's T and k >= 1, as every MoE target takes them.
ffi::Error CheckExperts(const char* target, ffi::AnyBuffer::Dimensions x, ffi::AnyBuffer experts) {
  auto dims = experts.dimensions();
  if (dims.size() != 2 || dims[0] != x[0] || dims[1] < 1)
    return Invalid(target, "experts must be (T, k) with T = " + std::to_string(x[0]) +
                               " and k >= 1, got " + Describe(experts.element_type(), dims));
  return ffi::Error::Success();
}

// block_m and ranks, as every MoE target takes them.
ffi::Error CheckAttrs(const char* target, int64_t block_m, int64_t ranks) {
  if (block_m < 1 || block_m > 256 || (block_m & (block_m - 1)))
    return Invalid(target,
                   "block_m must be a power of two in [1, 256], got " + std::to_string(block_m));
  if (ranks < 1) return Invalid(target, "ranks must be at least 1, got " + std::to_string(ranks));
  return ffi::Error::Success();
}

// What the platform's kernels add to the contract: the CPU reference nothing, the CUDA kernels
// bf16 tokens and block_m = 64 or 128.
ffi::Error CheckKernelContract(Platform platform, const char* target, ffi::AnyBuffer x,
                               int64_t block_m) {
  if (platform == Platform::kCpu) return ffi::Error::Success();
  if (x.element_type() != ffi::DataType::BF16)
    return Invalid(target, "the CUDA kernel takes bf16 tokens, got " +
                               Describe(x.element_type(), x.dimensions()));
  if (block_m != 64 && block_m != 128)
    return Invalid(target,
                   "the CUDA kernel needs block_m = 64 or 128, got " + std::to_string(block_m));
  return ffi::Error::Success();
}

// The routed and the shared experts' weights (prefix ""), or their gradients (prefix "d"), in
// the order of MoeInputs.
ffi::Error CheckWeights(const char* target, const std::string& prefix, const MoeDims& d,
                        ffi::DataType dtype, const ffi::AnyBuffer (&w)[6]) {
  auto check = [&](const char* name, ffi::AnyBuffer b, std::initializer_list<int64_t> shape) {
    return CheckBuffer(target, (prefix + name).c_str(), b, dtype, shape);
  };
  for (auto err : {check("w_gate", w[0], {d.E, d.H, d.I}), check("w_up", w[1], {d.E, d.H, d.I}),
                   check("w_down", w[2], {d.E, d.I, d.H}), check("ws_gate", w[3], {d.H, d.Is}),
                   check("ws_up", w[4], {d.H, d.Is}), check("ws_down", w[5], {d.Is, d.H})}) {
    if (err.failure()) return err;
  }
  return ffi::Error::Success();
}

// Checks the inputs and returns the sizes of the call.
ffi::ErrorOr<MoeDims> CheckInputs(const char* target, const MoeInputs& in, int64_t block_m,
                                  bool recompute, int64_t ranks) {
  auto x = in.x.dimensions(), wg = in.w_gate.dimensions(), wsg = in.ws_gate.dimensions();
  auto dtype = in.x.element_type();
  auto fail = [&](const std::string& what) { return ffi::Unexpected(Invalid(target, what)); };
  if ((dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16) || x.size() != 2)
    return fail("x must be bf16 or f32 (T, H), got " + Describe(dtype, x));
  const std::string H = std::to_string(x[1]);
  if (auto err = CheckExperts(target, x, in.experts); err.failure()) return ffi::Unexpected(err);
  if (wg.size() != 3 || wg[1] != x[1] || wg[0] < 1 || wg[2] < 1)
    return fail("w_gate must be (E, H, I) with H = " + H + ", got " +
                Describe(in.w_gate.element_type(), wg));
  if (wsg.size() != 2 || wsg[0] != x[1])
    return fail("ws_gate must be (H, Is) with H = " + H + ", got " +
                Describe(in.ws_gate.element_type(), wsg));
  if (auto err = CheckAttrs(target, block_m, ranks); err.failure()) return ffi::Unexpected(err);
  MoeDims d{x[0], x[1], wg[2], wg[0], in.experts.dimensions()[1], wsg[1], 0, block_m, recompute,
            ranks};
  d.R = RoutedRows(d.T * d.k, d.E, block_m);
  for (auto err : {CheckBuffer(target, "experts", in.experts, ffi::DataType::S32, {d.T, d.k}),
                   CheckBuffer(target, "weights", in.weights, ffi::DataType::F32, {d.T, d.k}),
                   CheckWeights(target, "", d, dtype,
                                {in.w_gate, in.w_up, in.w_down, in.ws_gate, in.ws_up,
                                 in.ws_down})}) {
    if (err.failure()) return ffi::Unexpected(err);
  }
  return d;
}

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

// y of x's dtype or f32; gu and gu_shared with the rows that d.recompute implies (zero with
// recompute).
ffi::Error CheckFwdResults(const char* target, const MoeDims& d, ffi::DataType dtype,
                           const MoeFwdResults& out) {
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

// The gradients and the backward's scratch of mok_moe_bwd (and mok_moe_bwd_fp8).
ffi::Error CheckBwdResults(const char* target, const MoeDims& d, ffi::DataType dtype,
                           const MoeBwdResults& out) {
  const ffi::DataType f32 = ffi::DataType::F32;
  for (auto err : {CheckBuffer(target, "dx", out.dx, dtype, {d.T, d.H}),
                   CheckBuffer(target, "dweights", out.dweights, f32, {d.T, d.k}),
                   CheckWeights(target, "d", d, dtype,
                                {out.dw_gate, out.dw_up, out.dw_down, out.dws_gate, out.dws_up,
                                 out.dws_down}),
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

// dy (T, H) of x's dtype or f32; the residuals as CheckFwdResults wants them; the gradients and
// the backward's scratch.
ffi::Error CheckBwdArgs(const char* target, const MoeDims& d, ffi::DataType dtype,
                        ffi::AnyBuffer dy, const MoeResiduals& res, const MoeBwdResults& out) {
  auto dydt = dy.element_type();
  if (dydt != dtype && dydt != ffi::DataType::F32)
    return Invalid(target, "dy must be of x's dtype or f32, got " +
                               Describe(dydt, dy.dimensions()));
  if (auto err = CheckBuffer(target, "dy", dy, dydt, {d.T, d.H}); err.failure()) return err;
  if (auto err = CheckResiduals(target, d, dtype, res); err.failure()) return err;
  return CheckBwdResults(target, d, dtype, out);
}

// The checks of mok_moe_fwd and mok_moe_bwd in order: the inputs, the platform's kernel
// contract, then `rest(dims, dtype)`, the target's other buffers given the sizes and x's dtype.
template <class CheckRest>
ffi::ErrorOr<MoeDims> CheckCall(Platform platform, const char* target, const MoeInputs& in,
                                int64_t block_m, bool recompute, int64_t ranks,
                                CheckRest rest) {
  auto dims = CheckInputs(target, in, block_m, recompute, ranks);
  if (dims.has_error()) return dims;
  for (auto err : {CheckKernelContract(platform, target, in.x, block_m),
                   rest(*dims, in.x.element_type())}) {
    if (err.failure()) return ffi::Unexpected(err);
  }
  return dims;
}

}  // namespace

ffi::ErrorOr<MoeDims> CheckFwdCall(Platform platform, const MoeInputs& in,
                                   const MoeFwdResults& out, int64_t block_m, bool recompute,
                                   int64_t ranks) {
  const char* target = "mok_moe_fwd";
  return CheckCall(platform, target, in, block_m, recompute, ranks,
                   [&](const MoeDims& d, ffi::DataType dtype) {
                     return CheckFwdResults(target, d, dtype, out);
                   });
}

ffi::ErrorOr<MoeDims> CheckBwdCall(Platform platform, ffi::AnyBuffer dy, const MoeInputs& in,
                                   const MoeResiduals& res, const MoeBwdResults& out,
                                   int64_t block_m, bool recompute, int64_t ranks) {
  const char* target = "mok_moe_bwd";
  return CheckCall(platform, target, in, block_m, recompute, ranks,
                   [&](const MoeDims& d, ffi::DataType dtype) {
                     return CheckBwdArgs(target, d, dtype, dy, res, out);
                   });
}

namespace {

// The inputs of the FP8 targets: x, experts, weights and the e4m3 weights with their scales,
// K-major for the forward (transposed, `as_is` false) or as they are for the backward.
ffi::ErrorOr<MoeDims> CheckFp8Inputs(const char* target, const MoeFp8Inputs& in, bool as_is,
                                     int64_t block_m, int64_t ranks) {
  auto x = in.x.dimensions(), wg = in.w_gate.dimensions(), wsg = in.ws_gate.dimensions();
  auto fail = [&](const std::string& what) { return ffi::Unexpected(Invalid(target, what)); };
  if (in.x.element_type() != ffi::DataType::BF16 || x.size() != 2)
    return fail("x must be bf16 (T, H), got " + Describe(in.x.element_type(), x));
  if (auto err = CheckExperts(target, x, in.experts); err.failure()) return ffi::Unexpected(err);
  const std::string h = std::to_string(x[1]);
  if (wg.size() != 3 || wg[as_is ? 1 : 2] != x[1] || wg[0] < 1 || wg[as_is ? 2 : 1] < 1)
    return fail(std::string("w_gate must be ") + (as_is ? "(E, H, I)" : "(E, I, H)") +
                " with H = " + h + ", got " + Describe(in.w_gate.element_type(), wg));
  if (wsg.size() != 2 || wsg[as_is ? 0 : 1] != x[1])
    return fail(std::string("ws_gate must be ") + (as_is ? "(H, Is)" : "(Is, H)") +
                " with H = " + h + ", got " + Describe(in.ws_gate.element_type(), wsg));
  if (auto err = CheckAttrs(target, block_m, ranks); err.failure()) return ffi::Unexpected(err);
  MoeDims d{x[0], x[1], wg[as_is ? 2 : 1], wg[0], in.experts.dimensions()[1],
            wsg[as_is ? 1 : 0], 0, block_m, false, ranks};
  if (d.H % 128 || d.I % 128 || d.Is % 128)
    return fail("H, I and Is must be multiples of 128 (the FP8 blocks), got " +
                std::to_string(d.H) + ", " + std::to_string(d.I) + ", " + std::to_string(d.Is));
  d.R = RoutedRows(d.T * d.k, d.E, d.block_m);
  const int64_t hb = d.H / 128, ib = d.I / 128, sb = d.Is / 128;
  const ffi::DataType f8 = ffi::DataType::F8E4M3FN, f32 = ffi::DataType::F32;
  // (rows, cols) of a weight as it is: swapped where the forward takes it K-major.
  auto weight = [&](const char* name, ffi::AnyBuffer b, std::initializer_list<int64_t> lead,
                    int64_t rows, int64_t cols) {
    std::vector<int64_t> shape(lead);
    shape.push_back(as_is ? rows : cols), shape.push_back(as_is ? cols : rows);
    auto got = b.dimensions();
    if (b.element_type() == f8 && got.size() == shape.size() &&
        std::equal(shape.begin(), shape.end(), got.begin()))
      return ffi::Error::Success();
    return Invalid(target, std::string(name) + " must be " + Describe(f8, shape) + ", got " +
                               Describe(b.element_type(), got));
  };
  for (auto err : {CheckBuffer(target, "experts", in.experts, ffi::DataType::S32, {d.T, d.k}),
                   CheckBuffer(target, "weights", in.weights, f32, {d.T, d.k}),
                   weight("w_gate", in.w_gate, {d.E}, d.H, d.I),
                   CheckBuffer(target, "w_gate_scale", in.w_gate_scale, f32, {d.E, hb, ib}),
                   weight("w_up", in.w_up, {d.E}, d.H, d.I),
                   CheckBuffer(target, "w_up_scale", in.w_up_scale, f32, {d.E, hb, ib}),
                   weight("w_down", in.w_down, {d.E}, d.I, d.H),
                   CheckBuffer(target, "w_down_scale", in.w_down_scale, f32, {d.E, ib, hb}),
                   weight("ws_gate", in.ws_gate, {}, d.H, d.Is),
                   CheckBuffer(target, "ws_gate_scale", in.ws_gate_scale, f32, {hb, sb}),
                   weight("ws_up", in.ws_up, {}, d.H, d.Is),
                   CheckBuffer(target, "ws_up_scale", in.ws_up_scale, f32, {hb, sb}),
                   weight("ws_down", in.ws_down, {}, d.Is, d.H),
                   CheckBuffer(target, "ws_down_scale", in.ws_down_scale, f32, {sb, hb})}) {
    if (err.failure()) return ffi::Unexpected(err);
  }
  return d;
}

}  // namespace

ffi::ErrorOr<MoeDims> CheckFp8Call(Platform platform, const MoeFp8Inputs& in,
                                   const MoeFwdFp8Results& out, int64_t block_m, int64_t ranks) {
  const char* target = "mok_moe_fwd_fp8";
  auto dims = CheckFp8Inputs(target, in, /*as_is=*/false, block_m, ranks);
  if (dims.has_error()) return dims;
  MoeDims d = *dims;
  const int64_t hb = d.H / 128, ib = d.I / 128, sb = d.Is / 128;
  const int64_t pitch = Fp8ScalePitch(d.R), shared_rows = d.Is > 0 ? d.T : 0;
  const ffi::DataType f8 = ffi::DataType::F8E4M3FN, f32 = ffi::DataType::F32,
                      s32 = ffi::DataType::S32, bf16 = ffi::DataType::BF16;
  const ffi::DataType ydt = out.y.element_type() == f32 ? f32 : bf16;
  // gu kept (R rows) or not (0 rows, recompute in MoeDims' sense).
  d.recompute = out.gu.dimensions().size() == 2 && out.gu.dimensions()[0] == 0 && d.R > 0;
  for (auto err : {CheckBuffer(target, "y", out.y, ydt, {d.T, d.H}),
                   CheckBuffer(target, "pos", out.pos, s32, {d.T, d.k}),
                   CheckBuffer(target, "offsets", out.offsets, s32, {d.E + 1}),
                   CheckBuffer(target, "rows", out.rows, s32, {d.R}),
                   CheckBuffer(target, "gu", out.gu, bf16, {d.recompute ? 0 : d.R, 2 * d.I}),
                   CheckBuffer(target, "gu_shared", out.gu_shared, bf16,
                               {d.recompute ? 0 : d.T, 2 * d.Is}),
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
                               {LayoutScratchInts(d.T, d.k, d.E)}),
                   CheckKernelContract(platform, target, in.x, block_m)}) {
    if (err.failure()) return ffi::Unexpected(err);
  }
  return d;
}

ffi::ErrorOr<MoeDims> CheckBwdFp8Call(Platform platform, ffi::AnyBuffer dy,
                                      const MoeFp8Inputs& in, const MoeFp8Residuals& res,
                                      const MoeBwdResults& out, const MoeBwdFp8Scratch& q,
                                      int64_t block_m, int64_t ranks) {
  const char* target = "mok_moe_bwd_fp8";
  auto dims = CheckFp8Inputs(target, in, /*as_is=*/true, block_m, ranks);
  if (dims.has_error()) return dims;
  const MoeDims& d = *dims;
  const int64_t hb = d.H / 128, pitch = Fp8ScalePitch(d.R), shared_rows = d.Is > 0 ? d.T : 0;
  const ffi::DataType f8 = ffi::DataType::F8E4M3FN, f32 = ffi::DataType::F32,
                      s32 = ffi::DataType::S32, bf16 = ffi::DataType::BF16;
  for (auto err : {CheckBuffer(target, "dy", dy, bf16, {d.T, d.H}),
                   CheckBuffer(target, "pos", res.pos, s32, {d.T, d.k}),
                   CheckBuffer(target, "offsets", res.offsets, s32, {d.E + 1}),
                   CheckBuffer(target, "rows", res.rows, s32, {d.R}),
                   CheckBuffer(target, "gu", res.gu, bf16, {d.R, 2 * d.I}),
                   CheckBuffer(target, "gu_shared", res.gu_shared, bf16, {d.T, 2 * d.Is}),
                   CheckBwdResults(target, d, bf16, out),
                   CheckBuffer(target, "dyq", q.dyq, f8, {d.R, d.H}),
                   CheckBuffer(target, "dyq_scale", q.dyq_scale, f32, {hb, pitch}),
                   CheckBuffer(target, "dyq_shared", q.dyq_shared, f8, {shared_rows, d.H}),
                   CheckBuffer(target, "dyq_shared_scale", q.dyq_shared_scale, f32,
                               {hb, Fp8ScalePitch(shared_rows)}),
                   CheckBuffer(target, "dguq", q.dguq, f8, {d.R, 2 * d.I}),
                   CheckBuffer(target, "dguq_scale", q.dguq_scale, f32, {2 * d.I / 128, pitch}),
                   CheckBuffer(target, "dguq_shared", q.dguq_shared, f8, {d.T, 2 * d.Is}),
                   CheckBuffer(target, "dguq_shared_scale", q.dguq_shared_scale, f32,
                               {2 * d.Is / 128, Fp8ScalePitch(d.T)}),
                   CheckKernelContract(platform, target, in.x, block_m)}) {
    if (err.failure()) return ffi::Unexpected(err);
  }
  return d;
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

ffi::ErrorOr<QuantizeDims> CheckQuantizeArgs(const char* target, ffi::AnyBuffer w,
                                             ffi::AnyBuffer data, ffi::AnyBuffer k_major,
                                             ffi::AnyBuffer scale) {
  auto dims = w.dimensions();
  const ffi::DataType dtype = w.element_type();
  if ((dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F32) || dims.size() < 2)
    return ffi::Unexpected(
        Invalid(target, "w must be bf16 or f32 (..., K, N), got " + Describe(dtype, dims)));
  const size_t rank = dims.size();
  QuantizeDims d{1, dims[rank - 2], dims[rank - 1], 0, 0};
  for (size_t i = 0; i + 2 < rank; ++i) d.batch *= dims[i];
  d.k_blocks = (d.K + 127) / 128, d.n_blocks = (d.N + 127) / 128;
  // Each result is w's leading dimensions and then its own two.
  auto check = [&](const char* name, ffi::AnyBuffer b, ffi::DataType want, int64_t m, int64_t n) {
    std::vector<int64_t> shape(dims.begin(), dims.end());
    shape[rank - 2] = m, shape[rank - 1] = n;
    auto got = b.dimensions();
    if (b.element_type() == want && got.size() == rank &&
        std::equal(shape.begin(), shape.end(), got.begin()))
      return ffi::Error::Success();
    return Invalid(target, std::string(name) + " must be " + Describe(want, shape) + ", got " +
                               Describe(b.element_type(), got));
  };
  const ffi::DataType f8 = ffi::DataType::F8E4M3FN;
  for (auto err : {check("data", data, f8, d.K, d.N), check("k_major", k_major, f8, d.N, d.K),
                   check("scale", scale, ffi::DataType::F32, d.k_blocks, d.n_blocks)}) {
    if (err.failure()) return ffi::Unexpected(err);
  }
  return d;
}

}  // namespace mok
