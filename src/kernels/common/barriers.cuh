// The mbarrier types every pipeline of the Hopper kernels uses.
#pragma once

#include <cutlass/arch/barrier.h>

namespace jagflash::kernels::common {

// A full barrier also counts the bytes its TMA loads deliver; an empty barrier counts arrivals.
using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

}  // namespace jagflash::kernels::common
