// Element types: sizes and float conversions usable on the host and in device code.
#pragma once

#include <jagflash/jagflash.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>

namespace jagflash {

inline size_t dtype_size(jf_dtype dtype) { return dtype == JF_FP32 ? 4 : 2; }

inline const char* dtype_name(jf_dtype dtype) {
  switch (dtype) {
    case JF_BF16:
      return "bf16";
    case JF_FP16:
      return "fp16";
    case JF_FP32:
      return "fp32";
  }
  return "unknown";
}

// Storage type per dtype, for templates that dispatch once per call.
template <jf_dtype D>
struct DtypeTraits;
template <>
struct DtypeTraits<JF_BF16> {
  using Storage = __nv_bfloat16;
};
template <>
struct DtypeTraits<JF_FP16> {
  using Storage = __half;
};
template <>
struct DtypeTraits<JF_FP32> {
  using Storage = float;
};

#if defined(__CUDACC__)
#define JF_CONVERT_HD __host__ __device__ __forceinline__
#else
#define JF_CONVERT_HD inline
#endif

JF_CONVERT_HD float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
JF_CONVERT_HD float to_float(__half x) { return __half2float(x); }
JF_CONVERT_HD float to_float(float x) { return x; }

template <typename T>
JF_CONVERT_HD T from_float(float x);
template <>
JF_CONVERT_HD __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
JF_CONVERT_HD __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
JF_CONVERT_HD float from_float<float>(float x) {
  return x;
}

// Calls f(Storage{}) with the storage type of `dtype`: one switch instead of one per call site.
template <typename F>
decltype(auto) dispatch_dtype(jf_dtype dtype, F&& f) {
  switch (dtype) {
    case JF_BF16:
      return f(__nv_bfloat16{});
    case JF_FP16:
      return f(__half{});
    default:
      return f(float{});
  }
}

}  // namespace jagflash
