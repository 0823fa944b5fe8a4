// One wgmma shape CuTe keeps behind CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED: m64n48k16 with both
// operands in shared memory and fp32 accumulators, for bf16 and fp16. The D = 96 backward's
// dQ = dS K gives each consumer warpgroup 48 of the 96 head-dim columns; without this shape CuTe's
// selector falls back to three n16 instructions a k-block, each re-reading dS's 2 KB from shared
// memory for a 64 x 16 x 16 product. Defining the macro instead would pull 76,000 lines of
// extended shapes into every kernel file (CI's build time, issue 27 item 6).
#pragma once

#include <cutlass/numeric_types.h>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include <cstdint>
#include <type_traits>

namespace jagflash::kernels::common {

// The operation: D (64 x 48 fp32, 24 registers a thread) += A (64 x 16) B (16 x 48), A and B by
// shared-memory descriptors; kMajorA/kMajorB as in CuTe's GMMA ops (K- or MN-major).
template <class Element, cute::GMMA::Major kMajorA, cute::GMMA::Major kMajorB>
struct Gmma64x48x16SS {
  static_assert(std::is_same_v<Element, cutlass::bfloat16_t> || std::is_same_v<Element, cutlass::half_t>,
                "bf16 or fp16 operands");
  using DRegisters = void;
  using ARegisters = uint64_t[1];
  using BRegisters = uint64_t[1];
  using CRegisters = float[24];

  CUTE_HOST_DEVICE static void fma(uint64_t const& desc_a, uint64_t const& desc_b, float& d00, float& d01,
                                   float& d02, float& d03, float& d04, float& d05, float& d06, float& d07,
                                   float& d08, float& d09, float& d10, float& d11, float& d12, float& d13,
                                   float& d14, float& d15, float& d16, float& d17, float& d18, float& d19,
                                   float& d20, float& d21, float& d22, float& d23,
                                   cute::GMMA::ScaleOut const scale_d = cute::GMMA::ScaleOut::One) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
#define JF_GMMA_64X48_OPERANDS                                                                         \
  : "+f"(d00), "+f"(d01), "+f"(d02), "+f"(d03), "+f"(d04), "+f"(d05), "+f"(d06), "+f"(d07), "+f"(d08),            \
    "+f"(d09), "+f"(d10), "+f"(d11), "+f"(d12), "+f"(d13), "+f"(d14), "+f"(d15), "+f"(d16), "+f"(d17),            \
    "+f"(d18), "+f"(d19), "+f"(d20), "+f"(d21), "+f"(d22), "+f"(d23)                                              \
  : "l"(desc_a), "l"(desc_b), "r"(int32_t(scale_d)), "n"(int32_t(kMajorA)), "n"(int32_t(kMajorB))
#define JF_GMMA_64X48_ASM(types)                                                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"                                                            \
  "wgmma.mma_async.sync.aligned.m64n48k16.f32." types                                                     \
  " "                                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, "                                                                                                 \
  "%23}, %24, %25, p, 1, 1, %27, %28;\n}\n"
    if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
      asm volatile(JF_GMMA_64X48_ASM("bf16.bf16") JF_GMMA_64X48_OPERANDS);
    } else {
      asm volatile(JF_GMMA_64X48_ASM("f16.f16") JF_GMMA_64X48_OPERANDS);
    }
#undef JF_GMMA_64X48_ASM
#undef JF_GMMA_64X48_OPERANDS
#else
    CUTE_INVALID_CONTROL_PATH("m64n48k16 wgmma needs sm_90a");
#endif
  }
};

}  // namespace jagflash::kernels::common

namespace cute {

// Its traits, in CuTe's terms for the GMMA shapes: 128 threads, A and B from shared memory, the
// 64 x 48 accumulator in the wgmma fragment layout.
template <class Element, GMMA::Major kMajorA, GMMA::Major kMajorB>
struct MMA_Traits<jagflash::kernels::common::Gmma64x48x16SS<Element, kMajorA, kMajorB>> {
  using ValTypeD = float;
  using ValTypeA = Element;
  using ValTypeB = Element;
  using ValTypeC = float;
  using FrgTypeA = GMMA::smem_desc<kMajorA>;
  using FrgTypeB = GMMA::smem_desc<kMajorB>;
  using Shape_MNK = Shape<_64, _48, _16>;
  using ThrID = Layout<_128>;
  using ALayout = GMMA::ABLayout<64, 16>;
  using BLayout = GMMA::ABLayout<48, 16>;
  using CLayout = GMMA::CLayout_64xN<48>;
  GMMA::ScaleOut accumulate_ = GMMA::ScaleOut::One;
};

}  // namespace cute
