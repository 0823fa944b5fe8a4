// The backward's roles inside a persistent CTA; the tiles come from the loading thread, which
// also decodes them (scheduler_bwd.cuh).
//  Loader (one thread of the producer warpgroup): per tile, K and V once, then Q with its lse
//    and dO with its delta for every Q block (and query head of the tile's group or split of it)
//    that sees the tile,
//    through the kStages ring.
//  Consumers (two warpgroups, 64 keys each): S^T, dP^T, P^T, dS^T, dV and dK in registers, dS
//    to shared memory, dQ = dS K into a dQ stage for the writer; dK, dV stored at the tile's end
//    through the dS buffers (epilogue_bwd.cuh).
//  dQ writer (dq_writer.cuh): adds each dQ stage into the fp32 accumulator with one bulk reduce.
#pragma once

#include "kernels/bwd/epilogue_bwd.cuh"
#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/bwd/scheduler_bwd.cuh"
#include "kernels/bwd/smem_stores_bwd.cuh"
#include "kernels/common/accumulator.cuh"
#include "kernels/common/block_sparse.cuh"
#include "kernels/common/ring.cuh"
#include "kernels/common/warpgroup_gemm.cuh"

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>

namespace jagflash::kernels::bwd {

using namespace cute;
using common::AccumulatorCoords;
using common::exp2_ftz;
using common::RingPosition;  // kernels/common/ring.cuh: every barrier wait (wait_full, wait_released)
using common::warpgroup_gemm;

// The consumer thread index (0-255), read with an asm volatile the compiler cannot hoist out
// of a loop: addresses derived from it are recomputed where they are used, not kept live.
__device__ __forceinline__ int fresh_consumer_thread() {
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return static_cast<int>(tid) - 128;
}

// The stats of one Q block (kStatRows floats from element `first`) by a 1D TMA load completing on
// `bar`.
__device__ __forceinline__ void load_stats(float* smem, const CUtensorMap* map, int64_t first,
                                           uint64_t* bar) {
  cute::SM90_TMA_LOAD_1D::copy(map, bar, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL), smem,
                               static_cast<int32_t>(first));
}

// The Q block of step i (m_lo <= i <= m_hi) of a tile's loop: [m_first, m_hi], then [m_lo, m_first).
// The loader and the consumers walk the same steps, so their rings stay in step.
__device__ __forceinline__ int32_t rotated_q_block(const TileInfo& t, int32_t i) {
  const int32_t m = i + (t.m_first - t.m_lo);
  return m > t.m_hi ? m - (t.m_hi - t.m_lo + 1) : m;
}

// Whether Q block m sees the tile's KV block at all: with kBlockSparse its map byte decides (read
// from the tile and the map's offsets where it is asked, in 32-bit arithmetic: a 64-bit column
// pointer kept across the consumers' loop pushed them into local memory), else always.
template <class Traits>
__device__ __forceinline__ bool q_block_visible(const Params<Traits>& p, const TileInfo& t, int32_t m) {
  if constexpr (Traits::kBlockSparse) {
    const int32_t key_blocks = (t.len_kv + BlockMask::kBlock - 1) / BlockMask::kBlock;
    const int32_t at = p.block_mask.offsets[t.batch] +
                       (m * Traits::kBlockM / BlockMask::kBlock) * key_blocks +
                       t.n_block * Traits::kBlockN / BlockMask::kBlock;
    return __ldg(p.block_mask.blocks + at) != 0;
  } else {
    return true;
  }
}

// Deterministic mode with a block-sparse map: the turn of the tile's KV block among the visible
// KV blocks of Q block m (of the mask's range `blocks`), in the plan's order of them.
template <class Traits>
__device__ __forceinline__ int32_t sparse_dq_turn(const Params<Traits>& p, const TileInfo& t, int32_t m,
                                                  IndexRange blocks, bool descending) {
  const uint8_t* row = p.block_mask.row(t.batch, m * Traits::kBlockM / BlockMask::kBlock, t.len_kv);
  const int32_t lo = descending ? t.n_block + 1 : static_cast<int32_t>(blocks.lo);
  const int32_t hi = descending ? static_cast<int32_t>(blocks.hi) : t.n_block - 1;
  int32_t turn = 0;
  for (int32_t n = lo; n <= hi; ++n) turn += row[n * Traits::kBlockN / BlockMask::kBlock] != 0 ? 1 : 0;
  return turn;
}

template <class Traits>
struct Loader {
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  static constexpr int kStages = Traits::kStages;

  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem) {
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.total_q, HeadDim{}, p.num_heads));
    Tensor mDo = p.tma_do.get_tma_tensor(make_shape(p.total_q, HeadDim{}, p.num_heads));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.total_kv, HeadDim{}, p.num_heads_kv));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.total_kv, HeadDim{}, p.num_heads_kv));
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sDo = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutK{});

    constexpr uint32_t kSlots = SharedStorage<Traits>::kTileSlots;
    const int32_t num_pairs = *p.num_pairs;
    const int32_t total_tiles = num_pairs * p.num_heads_kv * p.group_splits;
    uint32_t uses = 0;  // Q blocks loaded so far (the ring's position)
    for (uint32_t round = 0;; ++round) {
      const uint32_t slot = round % kSlots;
      wait_released(smem.tile_empty, RingPosition<kSlots>{round});
      const int32_t tile = next_tile(p, static_cast<int32_t>(round));
      const bool has_tile = tile < total_tiles;
      TileInfo t{};
      if (has_tile) {
        t = decode_tile(p, tile, num_pairs, smem.dq_turns_descending);
        smem.tile[slot] = t;
      }
      smem.has_tile[slot] = has_tile;
      ArrivalBarrier::arrive(&smem.tile_full[slot]);  // release: the consumers' wait acquires
      if (!has_tile) return;

      // K and V of the tile, once, issued right after the tile's first Q block: the first Q and
      // dO then load while the consumers finish the previous tile, and V (freed after the
      // previous tile's last dP GEMM) and K (after its last dQ GEMM) while they store its dK, dV.
      Tensor gK = local_tile(domain_offset(make_coord(t.kv_start, _0{}), mK(_, _, t.kv_head)),
                             Shape<BlockN, HeadDim>{}, make_coord(t.n_block, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(t.kv_start, _0{}), mV(_, _, t.kv_head)),
                             Shape<BlockN, HeadDim>{}, make_coord(t.n_block, _0{}));
      auto k_parts =
          tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto v_parts =
          tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      bool kv_issued = false;
      auto issue_kv = [&] {
        wait_released(&smem.v_empty, RingPosition<1>{round});  // K and V: one buffer each, per tile
        TxBarrier::arrive_and_expect_tx(&smem.v_full, Traits::kKBytes);
        copy(p.tma_v.with(smem.v_full), get<0>(v_parts), get<1>(v_parts));
        wait_released(&smem.k_empty, RingPosition<1>{round});
        TxBarrier::arrive_and_expect_tx(&smem.k_full, Traits::kKBytes);
        copy(p.tma_k.with(smem.k_full), get<0>(k_parts), get<1>(k_parts));
        kv_issued = true;
      };

      // Rows are addressed from the sequence's first token: a Q block past the sequence's end
      // reads the next sequence's rows (masked by the consumers) or zeros past the tensor. A
      // shared (pooled) query set is every sequence's, from its first row.
      const int32_t q_load_start = p.q_shared ? 0 : t.q_start;
      for (int32_t h = t.head_lo; h < t.head_end; ++h) {
        Tensor gQ = local_tile(domain_offset(make_coord(q_load_start, _0{}), mQ(_, _, h)),
                               Shape<BlockM, HeadDim>{}, make_coord(_, _0{}));
        Tensor gDo = local_tile(domain_offset(make_coord(t.q_start, _0{}), mDo(_, _, h)),
                                Shape<BlockM, HeadDim>{}, make_coord(_, _0{}));
        auto q_parts =
            tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        auto do_parts =
            tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sDo), group_modes<0, 2>(gDo));
        for (int32_t i = t.m_lo; i <= t.m_hi; ++i) {
          const int32_t m = rotated_q_block(t, i);
          if (!q_block_visible(p, t, m))
            continue;  // hidden by the block-sparse map (the consumers skip it too)
          const uint32_t stage = uses % kStages;
          wait_released(smem.q_empty, RingPosition<kStages>{uses});
          TxBarrier::arrive_and_expect_tx(&smem.q_full[stage], Traits::kQBytes + Traits::kStatBytes);
          copy(p.tma_q.with(smem.q_full[stage]), get<0>(q_parts)(_, m), get<1>(q_parts)(_, stage));
          // The stats from the aligned row at or before the block's first (the consumers skip the
          // first (row % 4)); the workspace holds kStatRows rows of slack after the last.
          const int64_t stat_row = int64_t(h) * p.q_stride + ((t.q_start + m * Traits::kBlockM) & ~3);
          load_stats(smem.lse.data() + stage * Traits::kStatStride, &p.lse_map, stat_row,
                     &smem.q_full[stage]);
          if (!kv_issued) issue_kv();
          wait_released(smem.do_empty, RingPosition<kStages>{uses});
          TxBarrier::arrive_and_expect_tx(&smem.do_full[stage], Traits::kQBytes + Traits::kStatBytes);
          copy(p.tma_do.with(smem.do_full[stage]), get<0>(do_parts)(_, m), get<1>(do_parts)(_, stage));
          load_stats(smem.delta.data() + stage * Traits::kStatStride, &p.delta_map, stat_row,
                     &smem.do_full[stage]);
          ++uses;
        }
      }
      if (!kv_issued) issue_kv();  // a tile no query sees still takes (and frees) its K and V
    }
  }
};

template <class Traits>
struct Consumer {
  using Element = typename Traits::Element;
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr uint32_t kDqStages = Traits::kDqStages;
  using StoreOffsets = SmemStoreOffsets<kBlockM, Traits::kHeadDim, Traits::WgKeys::value>;
  static constexpr uint32_t kDsBufferBytes = kBlockM * kBlockN * sizeof(Element);
  static constexpr uint32_t kDqStageBytes = Traits::kDqStageBytes;
  static_assert(kDsBufferBytes == DkvStaging<Traits::kHeadDim, int(sizeof(Element))>::kBufferBytes &&
                    Traits::kDsBuffers == 2 && Traits::WgKeys::value == 64,
                "the dK/dV staging's view of the dS buffers");

  static constexpr int kKeysPerWarpgroup = Traits::WgKeys::value;
  // dQ's k-blocks (16 keys each) over warpgroup 0's keys.
  static constexpr int kLowerKBlocks = kKeysPerWarpgroup / 16;
  // Warpgroup 1 idles on tiles whose upper keys are past the sequence (below). At D = 64 the
  // branches spread the dV/dK wgmma issue (descriptors rebuilt after the merge) and cost 5-16%
  // on the long batches (compare.py, H200, 2026-12-01) for +7% on short: D = 128 only.
  static constexpr bool kSkipIdleUpperKeys = Traits::kHeadDim == 128;

  // thread: index among the 256 consumer threads (warpgroup 0 owns keys 0-63 of the tile).
  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem, int thread) {
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmaDkv mma_dkv;
    typename Traits::TiledMmaDq mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(thread);
    auto thr_dkv = mma_dkv.get_thread_slice(thread);
    auto thr_dq = mma_dq.get_thread_slice(thread);

    // The shared-memory operands' descriptors (64-bit, one per k-block) are built right before
    // each GEMM from a base the compiler must reload (fresh_smem): built once before the loop,
    // the ~90 of them stayed live across it and spilled.
    auto fresh_smem = [&]() -> SharedStorage<Traits>& {
      SharedStorage<Traits>* s = &smem;
      asm volatile("" : "+l"(s));
      return *s;
    };
    auto sQ = [&] {
      return make_tensor(make_smem_ptr(fresh_smem().q.data()), typename Traits::SmemLayoutQ{});
    };
    auto sDo = [&] {
      return make_tensor(make_smem_ptr(fresh_smem().dout.data()), typename Traits::SmemLayoutQ{});
    };
    auto sQt = [&] {
      return make_tensor(make_smem_ptr(fresh_smem().q.data()), typename Traits::SmemLayoutQt{});
    };
    auto sDot = [&] {
      return make_tensor(make_smem_ptr(fresh_smem().dout.data()), typename Traits::SmemLayoutQt{});
    };
    auto sK = [&] {
      return make_tensor(make_smem_ptr(fresh_smem().k.data()), typename Traits::SmemLayoutK{});
    };
    auto sV = [&] {
      return make_tensor(make_smem_ptr(fresh_smem().v.data()), typename Traits::SmemLayoutK{});
    };
    auto sKt = [&] {
      return make_tensor(make_smem_ptr(fresh_smem().k.data()), typename Traits::SmemLayoutKt{});
    };
    auto sDs = [&] {
      return make_tensor(make_smem_ptr(fresh_smem().ds.data()), typename Traits::SmemLayoutDs{});
    };

    // S^T = K Q^T, dP^T = V dO^T: A (MMA, M, K) from K, V; B (MMA, N, K, stage) from Q, dO.
    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
    Tensor tSrDp = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
    Tensor s_rc = make_tensor(tSrS.data(), common::rowcol_layout(tSrS.layout()));
    Tensor dp_rc = make_tensor(tSrDp.data(), common::rowcol_layout(tSrDp.layout()));
    // P^T and dS^T in the input dtype, as the A operands of dV += P^T dO and dK += dS^T Q.
    Tensor tPrP = make_tensor_like<Element>(tSrS);
    Tensor tPrP_a = make_tensor(tPrP.data(), common::acc_as_a_operand_layout(tPrP.layout()));
    Tensor tDsrDs = make_tensor_like<Element>(tSrS);
    Tensor tDsrDs_a = make_tensor(tDsrDs.data(), common::acc_as_a_operand_layout(tDsrDs.layout()));
    // dV, dK: B (MMA, N, K, stage) from dO^T and Q^T; fp32 accumulators for the whole tile.
    Tensor tDVrDV = partition_fragment_C(mma_dkv, Shape<BlockN, HeadDim>{});
    Tensor tDKrDK = partition_fragment_C(mma_dkv, Shape<BlockN, HeadDim>{});
    // dQ = dS K: A (MMA, M, K, buffer) from dS, B (MMA, N, K) from K^T; the partial goes to a dQ stage.
    Tensor tDQrDQ = partition_fragment_C(mma_dq, Shape<BlockM, HeadDim>{});

    const AccumulatorCoords coords(thread);
    constexpr int kRows = decltype(size<0>(s_rc))::value;  // 2
    constexpr int kCols = decltype(size<1>(s_rc))::value;  // 16: query rows of the Q block
    // The score modifier (none in the default kernels: nothing of it is compiled). Softcap's dS
    // takes dscore = 1 - t^2 of each score's tanh t: at D = 64 kept from the tanh to dS as half
    // pairs (16 registers, 11 bits of a value in [0, 1], next to the 8 of the bf16 dS it scales);
    // at D = 128, where dK and dV hold 128 registers a thread and those 16 spilled (check_sass),
    // recovered from P and the lse (KernelScoreMod::dscore_of_p, one MUFU.LG2 a score more).
    using Mod = typename Traits::ScoreMod;
    constexpr bool kKeepDscore = Mod::kSoftcap && Traits::kHeadDim == 64;
    [[maybe_unused]] __half2 dscore[kRows][kCols / 2];
    const int lane = thread % 32;
    // Q blocks consumed so far: the Q/dO ring's position and, as every block hands one dQ stage
    // to the writer, the dQ ring's too (one counter: two kept a register more across the loop).
    uint32_t uses = 0;
    constexpr uint32_t kSlots = SharedStorage<Traits>::kTileSlots;

    // Hands a dQ stage to the writer: the targets (thread 0) and the partial, made visible to
    // the bulk copy's async proxy before the arrival.
    auto wait_dq_stage = [&](uint32_t stage) { wait_released(smem.dq_empty, RingPosition<kDqStages>{uses}); };
    auto publish_dq_stage = [&](uint32_t stage) {
      cutlass::arch::fence_view_async_shared();
      __syncwarp();
      if (lane == 0) ArrivalBarrier::arrive(&smem.dq_full[stage]);
    };

    // pooled_dq_sum: the dQ ring counts handed-over stages (flushes), not Q blocks; the open
    // stage (if any) sums the partials of query head open_head.
    uint32_t flushes = 0;
    int32_t open_head = -1;
    auto flush_open_stage = [&] {
      if (open_head >= 0) {
        publish_dq_stage(flushes % kDqStages);
        ++flushes;
        open_head = -1;
      }
    };

    for (uint32_t round = 0;; ++round) {
      const uint32_t slot = round % kSlots;
      wait_full(smem.tile_full, RingPosition<kSlots>{round});
      if (!smem.has_tile[slot]) {
        if (p.pooled_dq_sum) flush_open_stage();
        const uint32_t ring = p.pooled_dq_sum ? flushes : uses;
        const uint32_t stage = ring % kDqStages;
        wait_released(smem.dq_empty, RingPosition<kDqStages>{ring});
        if (thread == 0) smem.dq_target[stage].stop = 1;
        publish_dq_stage(stage);
        return;
      }
      // The tile is read from its slot where it is used (the slot stays valid until this tile's
      // tile_empty arrival): kept in registers across the loop, its fields spilled.
      const TileInfo& t = smem.tile[slot];
      if (p.pooled_dq_sum && open_head != t.head_lo) flush_open_stage();
      wait_full(&smem.k_full, RingPosition<1>{round});
      wait_full(&smem.v_full, RingPosition<1>{round});
      clear(tDVrDV);
      clear(tDKrDK);
      const int32_t key0 = t.n_block * kBlockN;  // first key of the tile in its sequence

      for (int32_t h = t.head_lo; h < t.head_end; ++h) {
        for (int32_t i = t.m_lo; i <= t.m_hi; ++i) {
          const int32_t m = rotated_q_block(t, i);  // the Q block of the tile's i-th (from m_lo) step
          // With a block-sparse map the Q blocks it hides are skipped, as the loader skips them.
          if (!q_block_visible(p, t, m)) continue;
          const RingPosition<kStages> q_at{uses};  // the Q/dO ring
          const uint32_t stage = q_at.stage(), ds_buf = uses % Traits::kDsBuffers;
          const int32_t row0 = m * kBlockM;
          // A short sequence's last KV block may end within the tile's lower 64 keys: then
          // warpgroup 1 (the upper keys) skips S^T, dP^T, dS, dV and dK and dQ = dS K runs over
          // the lower 64 keys only. (Per block, a causal or window edge hiding the upper keys
          // from a Q block would qualify too; the predicates it needed pushed the tile's round
          // counter into local memory at D = 128.)
          const bool upper_keys_seen = !kSkipIdleUpperKeys || key0 + kKeysPerWarpgroup < t.len_kv;
          const bool computes = thread < 128 || upper_keys_seen;
          // The tile's last dP GEMM frees V early; with a block-sparse map the last visible step is
          // not known ahead, so V is freed at the tile's end instead (below).
          const bool last_dp = !Traits::kBlockSparse && i == t.m_hi && h == t.head_end - 1;
          if (computes) {
            wait_full(smem.q_full, q_at);
            warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false>(
                mma_sdp, thr_sdp.partition_fragment_A(sK()),
                thr_sdp.partition_fragment_B(sQ())(_, _, _, stage), tSrS);
            wait_full(smem.do_full, q_at);
            warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false>(
                mma_sdp, thr_sdp.partition_fragment_A(sV()),
                thr_sdp.partition_fragment_B(sDo())(_, _, _, stage), tSrDp);

            // The lse and delta of the Q block's rows (this thread's columns) are read from shared
            // memory where they are used: kept in registers they pushed the consumers into spills.
            const int stat_skip = (t.q_start + row0) & 3;
            const float* lse_c = smem.lse.data() + stage * Traits::kStatStride + stat_skip + coords.col_base;
            const float* delta_c =
                smem.delta.data() + stage * Traits::kStatStride + stat_skip + coords.col_base;
            // Whether every (row, key) pair of the block is visible and inside both sequences:
            // then no mask arithmetic at all (the bulk of a long sequence's blocks).
            const int32_t row_last = row0 + kBlockM - 1, key_last = key0 + kBlockN - 1;
            const bool full_block = row_last < t.len_q && key_last < t.len_kv &&
                                    p.mask.key_range(row_last, t.len_q, t.len_kv).lo <= key0 &&
                                    p.mask.key_range(row0, t.len_q, t.len_kv).hi >= key_last;

            warpgroup_wait<1>();  // S^T is ready; dP^T may still run
            warpgroup_fence_operand(tSrS);
            if constexpr (!Mod::kNone) {
              // S^T: keys j along the rows, queries i along the columns; d = j - i - (Lk - Lq).
              float row_base[kRows];
#pragma unroll
              for (int r = 0; r < kRows; ++r)
                row_base[r] =
                    static_cast<float>(key0 + coords.row(r) - row0 - coords.col_base - (t.len_kv - t.len_q));
              if constexpr (Mod::kGeneric) {
                // Its dS is P (dP - delta): no dscore kept (KernelScoreMod::Policy).
                static_assert(Mod::Policy::kUnitDerivative,
                              "the Hopper backward serves generic modifiers whose dscore is 1");
                int32_t key_pos[kRows];
#pragma unroll
                for (int r = 0; r < kRows; ++r) key_pos[r] = key0 + coords.row(r);
                Mod::template apply_generic<false>(s_rc, p.score_mod, h, key_pos, row0 + coords.col_base,
                                                   t.len_q, t.len_kv);
              } else {
                // The slope read per block (an L1 hit), not kept across the loop: a register less.
                Mod::template apply<-1>(s_rc, p.score_mod, Mod::raw_slope(p.score_mod, h), row_base);
              }
              if constexpr (kKeepDscore) {  // before the mask: t is finite, a masked score is not
#pragma unroll
                for (int r = 0; r < kRows; ++r)
#pragma unroll
                  for (int c = 0; c < kCols; c += 2)
                    dscore[r][c / 2] = __floats2half2_rn(fmaf(-s_rc(r, c), s_rc(r, c), 1.f),
                                                         fmaf(-s_rc(r, c + 1), s_rc(r, c + 1), 1.f));
              }
            }
            // A block with hidden pairs (a mask edge, a sequence's end) first sets their scores to
            // -inf in place; every block then takes the same exp2 loop (exp2(-inf) = 0). A thread
            // holds two keys (rows) of S^T: per key, the queries that see it (the mask policy's
            // query_range, empty past the sequence's keys), relative to the thread's first column:
            // two ranges a thread instead of one per column.
            if (!full_block) {
              const int32_t col0 = row0 + coords.col_base;
#pragma unroll
              for (int r = 0; r < kRows; ++r) {
                const int32_t j = key0 + coords.row(r);
                const IndexRange queries =
                    j < t.len_kv ? p.mask.query_range(j, t.len_q, t.len_kv) : IndexRange{0, -1};
                const int32_t lo = static_cast<int32_t>(queries.lo) - col0;
                const int32_t hi = static_cast<int32_t>(queries.hi) - col0;
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                  const int off = AccumulatorCoords::col_offset(c);
                  if (off < lo || off > hi) s_rc(r, c) = -INFINITY;
                }
              }
            }
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
              for (int c = 0; c < kCols; ++c)
                s_rc(r, c) =
                    exp2_ftz(fmaf(s_rc(r, c), p.scale_log2, -lse_c[AccumulatorCoords::col_offset(c)]));
            warpgroup_wait<0>();
            warpgroup_fence_operand(tSrDp);
            if (last_dp) {
              __syncwarp();  // the tile's last dP GEMM has read V: the next tile's may load
              if (lane == 0) ArrivalBarrier::arrive(&smem.v_empty);
            }
            if constexpr (Mod::kSoftcap && !kKeepDscore) {
#pragma unroll
              for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                  const int off = AccumulatorCoords::col_offset(c);
                  dp_rc(r, c) = s_rc(r, c) * (dp_rc(r, c) - delta_c[off]) *
                                Mod::dscore_of_p(s_rc(r, c), lse_c[off], p.score_mod);
                }
            } else if constexpr (kKeepDscore) {
#pragma unroll
              for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int c = 0; c < kCols; c += 2) {
                  const float2 d = __half22float2(dscore[r][c / 2]);
                  dp_rc(r, c) = s_rc(r, c) * (dp_rc(r, c) - delta_c[AccumulatorCoords::col_offset(c)]) * d.x;
                  dp_rc(r, c + 1) = s_rc(r, c + 1) *
                                    (dp_rc(r, c + 1) - delta_c[AccumulatorCoords::col_offset(c + 1)]) * d.y;
                }
            } else {
#pragma unroll
              for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int c = 0; c < kCols; ++c)
                  dp_rc(r, c) = s_rc(r, c) * (dp_rc(r, c) - delta_c[AccumulatorCoords::col_offset(c)]);
            }
#pragma unroll
            for (int e = 0; e < size(tSrS); ++e) {
              tPrP(e) = static_cast<Element>(tSrS(e));
              tDsrDs(e) = static_cast<Element>(tSrDp(e));
            }
            // dS to shared memory for dQ = dS K (the other warpgroup needs this one's keys), by
            // stmatrix from addresses derived here from a thread index read afresh (kept across the
            // loop, they spilled).
            store_ds_smem<StoreOffsets>(tDsrDs,
                                        cute::cast_smem_ptr_to_uint(smem.ds.data()) + ds_buf * kDsBufferBytes,
                                        fresh_consumer_thread());
            cutlass::arch::fence_view_async_shared();
          } else if (last_dp) {
            __syncwarp();  // no dP GEMM of this warpgroup reads V any more
            if (lane == 0) ArrivalBarrier::arrive(&smem.v_empty);
          }
          // This block's dQ partial into the next dQ stage, with where it goes; with pooled_dq_sum
          // into the open stage (opened here with the shared rows as its target), handed over later.
          auto store_dq = [&] {
            if (p.pooled_dq_sum) {
              const uint32_t dq_stage = flushes % kDqStages;
              const uint32_t stage_smem =
                  cute::cast_smem_ptr_to_uint(smem.dq.data()) + dq_stage * kDqStageBytes;
              if (open_head >= 0) {
                add_dq_smem<StoreOffsets>(tDQrDQ, stage_smem, fresh_consumer_thread());
                return;
              }
              if (flushes >= kDqStages) wait_released(smem.dq_empty, RingPosition<kDqStages>{flushes});
              store_dq_smem<StoreOffsets>(tDQrDQ, stage_smem, fresh_consumer_thread());
              if (thread == 0) {
                DqTarget target{};
                target.row = int64_t(h) * p.dq_rows + row0;
                target.rows = min(kBlockM, t.len_q - row0);
                smem.dq_target[dq_stage] = target;
              }
              open_head = h;
              return;
            }
            const uint32_t dq_stage = uses % kDqStages;
            wait_dq_stage(dq_stage);
            store_dq_smem<StoreOffsets>(
                tDQrDQ, cute::cast_smem_ptr_to_uint(smem.dq.data()) + dq_stage * kDqStageBytes,
                fresh_consumer_thread());
            if (thread == 0) {
              DqTarget target{};
              target.row = int64_t(h) * p.dq_rows + t.q_start + row0;
              target.rows = min(kBlockM, t.len_q - row0);
              if (p.dq_sems != nullptr) {
                // The KV blocks that see this Q block add in the plan's order of them (first to
                // last, or last to first): this one's turn comes after those handed out before.
                const IndexRange n = p.mask.kv_blocks_of_q_block(m, kBlockM, kBlockN, t.len_q, t.len_kv);
                target.sem = h * p.total_q + t.q_start + row0;
                if constexpr (Traits::kBlockSparse)
                  target.sem_turn = sparse_dq_turn(p, t, m, n, smem.dq_turns_descending);
                else
                  target.sem_turn = smem.dq_turns_descending ? static_cast<int32_t>(n.hi) - t.n_block
                                                             : t.n_block - static_cast<int32_t>(n.lo);
              }
              smem.dq_target[dq_stage] = target;
            }
            publish_dq_stage(dq_stage);
          };
          auto issue_dq = [&] {
            if (upper_keys_seen) {
              warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false>(
                  mma_dq, thr_dq.partition_fragment_A(sDs())(_, _, _, ds_buf),
                  thr_dq.partition_fragment_B(sKt()), tDQrDQ);
            } else {  // the lower 64 keys: the first half of the GEMM's k-blocks
              warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false, /*kCommit=*/true,
                             /*kKBlocks=*/kLowerKBlocks>(mma_dq,
                                                         thr_dq.partition_fragment_A(sDs())(_, _, _, ds_buf),
                                                         thr_dq.partition_fragment_B(sKt()), tDQrDQ);
            }
          };
          auto issue_dv = [&] {
            warpgroup_gemm</*kZeroInit=*/false, /*kARegisters=*/true, /*kWait=*/false>(
                mma_dkv, tPrP_a, thr_dkv.partition_fragment_B(sDot())(_, _, _, stage), tDVrDV);
          };
          auto issue_dk = [&] {
            warpgroup_gemm</*kZeroInit=*/false, /*kARegisters=*/true, /*kWait=*/false>(
                mma_dkv, tDsrDs_a, thr_dkv.partition_fragment_B(sQt())(_, _, _, stage), tDKrDK);
          };
          auto release_stage = [&] {  // dV and dK are done: Q and dO of the stage are free
            warpgroup_fence_operand(tDVrDV);
            warpgroup_fence_operand(tDKrDK);
            warpgroup_fence_operand(tPrP);
            warpgroup_fence_operand(tDsrDs);
            __syncwarp();
            if (lane == 0) {
              ArrivalBarrier::arrive(&smem.q_empty[stage]);
              ArrivalBarrier::arrive(&smem.do_empty[stage]);
            }
          };
          // Once dQ is done its partial goes to the dQ stage while the GEMMs after it still run,
          // so the tensor cores are not idle during the stage's stores.
          if (!computes) {  // warpgroup 1 with no visible key: its half of dQ only
            // Warpgroup 0 meets this barrier at another instruction (below): the unaligned form
            // (bar.sync there and here was a divergent barrier to compute-sanitizer's synccheck).
            __syncwarp();
            common::named_barrier_sync_unaligned(1, 256);  // warpgroup 0's dS is in shared memory
            issue_dq();
            warpgroup_wait<0>();
            warpgroup_fence_operand(tDQrDQ);
            store_dq();
            release_stage();
          } else if constexpr (Traits::kHeadDim == 64) {
            // dQ first, then dV and dK.
            cutlass::arch::NamedBarrier::sync(256, 1);  // both warpgroups' dS are in shared memory
            issue_dq();
            issue_dv();
            issue_dk();
            warpgroup_wait<2>();  // dQ is done; dV and dK may still run
            warpgroup_fence_operand(tDQrDQ);
            store_dq();
            warpgroup_wait<0>();
            release_stage();
          } else {
            // dV first, hiding the wait for the other warpgroup's dS; then dQ and dK (dQ first
            // after the barrier, with dV and dK behind it, spilled at D = 128).
            issue_dv();
            // Unaligned where warpgroup 1 may meet it in the branch above instead.
            if constexpr (kSkipIdleUpperKeys) {
              common::named_barrier_sync_unaligned(1, 256);  // both warpgroups' dS are in shared memory
            } else {
              cutlass::arch::NamedBarrier::sync(256, 1);
            }
            issue_dq();
            issue_dk();
            warpgroup_wait<1>();  // dV and dQ are done; dK may still run
            warpgroup_fence_operand(tDQrDQ);
            store_dq();
            warpgroup_wait<0>();
            release_stage();
          }
          ++uses;
        }
      }
      // The tile's last dQ GEMM has read K (and its last dP GEMM V, freed there unless the tile
      // had no Q block or a block-sparse map): the loader may bring the next tile's.
      __syncwarp();
      if (lane == 0) {
        if (Traits::kBlockSparse || t.m_lo > t.m_hi) ArrivalBarrier::arrive(&smem.v_empty);
        ArrivalBarrier::arrive(&smem.k_empty);
      }
      store_dkdv<Traits>(p, t, tDKrDK, tDVrDV, cute::cast_smem_ptr_to_uint(smem.ds.data()),
                         fresh_consumer_thread());
      __syncwarp();
      if (lane == 0) ArrivalBarrier::arrive(&smem.tile_empty[slot]);
    }
  }
};

}  // namespace jagflash::kernels::bwd
