// GPU test of the forward's device-built plan: for each batch and mask, the plan the kernels
// read (pairs in plan order, through vals_out) must list exactly the host scheduler's tiles in
// the host's order (schedule::sort_sequences_heaviest_first), with the keys that order implies,
// from either builder (one CTA for small plans, scan + fill + radix sort for any), which must
// agree array for array.
#include "gen/distributions.hpp"
#include "schedule/plan.hpp"
#include "schedule/plan_device.hpp"
#include "testing/device_buffer.hpp"
#include "testing/host_batch.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace jagflash {
namespace {

using testing::DeviceBuffer;

void expect_device_plan_matches_host(const std::vector<int32_t>& len_q, const std::vector<int32_t>& len_kv,
                                     const MaskPolicy& mask, const std::string& what,
                                     schedule::PlanBuilder builder) {
  SCOPED_TRACE(what + (builder == schedule::PlanBuilder::kSmall   ? " (small builder)"
                       : builder == schedule::PlanBuilder::kLarge ? " (large builder)"
                                                                  : " (auto builder)"));
  const std::vector<int32_t> q_off = test::offsets_from_lengths(len_q),
                             kv_off = test::offsets_from_lengths(len_kv);
  const auto batch = static_cast<int32_t>(len_q.size());
  constexpr int kTileM = 128, kTileN = 128;
  const schedule::DevicePlanLayout layout =
      schedule::DevicePlanLayout::make(0, batch, q_off.back(), kv_off.back(), kTileM, kTileN);
  DeviceBuffer d_q = DeviceBuffer::from_host(q_off), d_kv = DeviceBuffer::from_host(kv_off);
  DeviceBuffer flag = DeviceBuffer::from_host(std::vector<int32_t>{0});
  DeviceBuffer workspace(layout.total_bytes);
  DeviceBuffer stored_key = DeviceBuffer::from_host(std::vector<schedule::PlanKey>{schedule::PlanKey{}});
  const schedule::PlanKey key = schedule::plan_key({kTileM, kTileN}, batch, q_off.back(), kv_off.back());
  ASSERT_EQ(cudaSuccess, schedule::build_device_plan(
                             d_q.as<int32_t>(), d_kv.as<int32_t>(), batch, kTileM, kTileN, flag.as<int32_t>(),
                             stored_key.as<schedule::PlanKey>(), key, workspace.get(), layout, nullptr,
                             /*first_block_first=*/false, builder));
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  schedule::PlanKey stored{};
  stored_key.to_host(&stored);
  ASSERT_TRUE(schedule::same_plan_key(stored, key)) << "the build stores the key a reusing call checks";
  std::vector<char> ws(layout.total_bytes);
  workspace.to_host(ws.data());
  auto array = [&](size_t offset) { return reinterpret_cast<const int32_t*>(ws.data() + offset); };
  const int32_t num_pairs = *array(layout.num_pairs);

  std::vector<schedule::Tile> tiles =
      schedule::build_tiles(q_off.data(), kv_off.data(), batch, /*num_heads=*/1, mask, {kTileM, kTileN},
                            schedule::Direction::kForward);
  // One head: the device plan lists pairs, whose order does not depend on where the heads go.
  schedule::sort_sequences_heaviest_first(tiles, q_off.data(), kv_off.data(), {kTileM, kTileN},
                                          schedule::kHeadsInnermost);
  ASSERT_EQ(static_cast<size_t>(num_pairs), tiles.size());
  ASSERT_LE(num_pairs, layout.max_pairs);
  const int32_t* sorted = array(layout.vals_out);
  const auto* keys = reinterpret_cast<const uint64_t*>(ws.data() + layout.keys_out);
  for (int32_t i = 0; i < num_pairs; ++i) {
    const int32_t pair = sorted[i];
    ASSERT_GE(pair, 0);
    ASSERT_LT(pair, num_pairs);
    ASSERT_EQ(array(layout.pair_batch)[pair], tiles[i].batch) << "position " << i;
    ASSERT_EQ(array(layout.pair_block)[pair], tiles[i].block) << "position " << i;
    const int32_t b = tiles[i].batch;
    const uint64_t weight =
        schedule::sequence_weight(q_off[b + 1] - q_off[b], kv_off[b + 1] - kv_off[b], {kTileM, kTileN});
    ASSERT_EQ(keys[i], ((weight + 1) << layout.batch_bits) | static_cast<uint64_t>(batch - 1 - b))
        << "position " << i;
  }
}

// Every builder that can build the plan (the small one only up to kSmallPlanMaxPairs pairs).
void expect_device_plan_matches_host(const std::vector<int32_t>& len_q, const std::vector<int32_t>& len_kv,
                                     const MaskPolicy& mask, const std::string& what) {
  const int64_t total_q = test::offsets_from_lengths(len_q).back();
  const int64_t max_pairs = total_q / 128 + static_cast<int64_t>(len_q.size()) + 1;
  for (schedule::PlanBuilder b :
       {schedule::PlanBuilder::kAuto, schedule::PlanBuilder::kSmall, schedule::PlanBuilder::kLarge}) {
    if (b == schedule::PlanBuilder::kSmall && max_pairs > schedule::kSmallPlanMaxPairs) continue;
    expect_device_plan_matches_host(len_q, len_kv, mask, what, b);
  }
}

MaskPolicy window(int32_t left, int32_t right) { return MaskPolicy::from(JF_MASK_WINDOW, left, right); }

TEST(GpuDevicePlan, MatchesTheHostSchedulerInOrderAndCost) {
  const std::vector<MaskPolicy> masks = {MaskPolicy::from(JF_MASK_NONE, -1, -1),
                                         MaskPolicy::from(JF_MASK_CAUSAL, -1, -1), window(200, 0),
                                         window(64, 300)};
  const std::vector<std::string> mask_names = {"none", "causal", "window(200,0)", "window(64,300)"};
  for (size_t m = 0; m < masks.size(); ++m) {
    for (const std::string& name : gen::distribution_names()) {
      const std::vector<int32_t> lengths = gen::generate_lengths(name, gen::kDefaultSeed);
      expect_device_plan_matches_host(lengths, lengths, masks[m], name + " " + mask_names[m]);
    }
    // Empty and one-row sequences, block edges, a long sequence among short ones, q != kv.
    const std::vector<int32_t> awkward_q = {0, 1, 63, 64, 65, 127, 128, 129, 0, 0, 300, 16384, 7, 0, 257};
    const std::vector<int32_t> awkward_kv = {5, 0, 64, 200, 1, 127, 300, 129, 0, 9, 17, 16000, 1000, 3, 0};
    expect_device_plan_matches_host(awkward_q, awkward_q, masks[m], "awkward self " + mask_names[m]);
    expect_device_plan_matches_host(awkward_q, awkward_kv, masks[m], "awkward q != kv " + mask_names[m]);
    expect_device_plan_matches_host({0, 0, 0}, {0, 4, 0}, masks[m], "no q rows " + mask_names[m]);
  }
}

// The one-CTA builder and the large one give the same plan, array for array, in both block
// orders, on random small batches (lengths 0 to 512, a quarter of them empty; 600 sequences come
// near the small builder's capacity of 2048 pairs); past it the small builder refuses and kAuto takes the
// large one.
TEST(GpuDevicePlan, SmallAndLargeBuildersGiveTheSamePlan) {
  uint64_t state = 12345;
  auto next = [&state](uint32_t bound) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int32_t>((state >> 33) % bound);
  };
  constexpr int kTileM = 128, kTileN = 64;
  for (int32_t batch : {1, 2, 8, 64, 256, 600}) {
    for (bool first_block_first : {false, true}) {
      std::vector<int32_t> len_q(batch), len_kv(batch);
      for (int32_t b = 0; b < batch; ++b) {
        len_q[b] = next(4) == 0 ? 0 : next(513);
        len_kv[b] = next(4) == 0 ? 0 : next(513);
      }
      SCOPED_TRACE("B=" + std::to_string(batch) + " first_block_first=" + std::to_string(first_block_first));
      const std::vector<int32_t> q_off = test::offsets_from_lengths(len_q),
                                 kv_off = test::offsets_from_lengths(len_kv);
      const schedule::DevicePlanLayout layout =
          schedule::DevicePlanLayout::make(0, batch, q_off.back(), kv_off.back(), kTileM, kTileN);
      ASSERT_LE(layout.max_pairs, schedule::kSmallPlanMaxPairs);
      DeviceBuffer d_q = DeviceBuffer::from_host(q_off), d_kv = DeviceBuffer::from_host(kv_off);
      DeviceBuffer flag = DeviceBuffer::from_host(std::vector<int32_t>{0});
      const schedule::PlanKey key = schedule::plan_key({kTileM, kTileN}, batch, q_off.back(), kv_off.back());
      std::vector<std::vector<char>> built;
      for (schedule::PlanBuilder b : {schedule::PlanBuilder::kSmall, schedule::PlanBuilder::kLarge}) {
        DeviceBuffer workspace(layout.total_bytes);
        // Poison: a counter the build must reset, arrays it must fill.
        ASSERT_EQ(cudaSuccess, cudaMemset(workspace.get(), 0x5a, layout.total_bytes));
        DeviceBuffer stored_key =
            DeviceBuffer::from_host(std::vector<schedule::PlanKey>{schedule::PlanKey{}});
        ASSERT_EQ(cudaSuccess,
                  schedule::build_device_plan(d_q.as<int32_t>(), d_kv.as<int32_t>(), batch, kTileM, kTileN,
                                              flag.as<int32_t>(), stored_key.as<schedule::PlanKey>(), key,
                                              workspace.get(), layout, nullptr, first_block_first, b));
        ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
        schedule::PlanKey stored{};
        stored_key.to_host(&stored);
        ASSERT_TRUE(schedule::same_plan_key(stored, key));
        built.emplace_back(layout.total_bytes);
        workspace.to_host(built.back().data());
      }
      auto ints = [&](int which, size_t offset) {
        return reinterpret_cast<const int32_t*>(built[which].data() + offset);
      };
      const int32_t pairs = *ints(0, layout.num_pairs);
      ASSERT_EQ(pairs, *ints(1, layout.num_pairs));
      int32_t expected = 0;
      for (int32_t b = 0; b < batch; ++b) expected += (len_q[b] + kTileM - 1) / kTileM;
      ASSERT_EQ(pairs, expected);
      EXPECT_EQ(*ints(0, layout.tile_counter), 0);
      EXPECT_EQ(*ints(1, layout.tile_counter), 0);
      for (int32_t i = 0; i < pairs; ++i) {
        const int32_t pair = ints(0, layout.vals_out)[i];
        ASSERT_EQ(pair, ints(1, layout.vals_out)[i]) << "position " << i;
        ASSERT_GE(pair, 0);
        ASSERT_LT(pair, pairs);
        ASSERT_EQ(ints(0, layout.pair_batch)[pair], ints(1, layout.pair_batch)[pair]) << "pair " << pair;
        ASSERT_EQ(ints(0, layout.pair_block)[pair], ints(1, layout.pair_block)[pair]) << "pair " << pair;
        const auto* keys0 = reinterpret_cast<const uint64_t*>(built[0].data() + layout.keys_out);
        const auto* keys1 = reinterpret_cast<const uint64_t*>(built[1].data() + layout.keys_out);
        ASSERT_EQ(keys0[i], keys1[i]) << "position " << i;
      }
    }
  }
  // Past the small builder's capacity: refused when asked for, the large one under kAuto.
  const schedule::DevicePlanLayout big = schedule::DevicePlanLayout::make(0, 4000, 4000, 4000, 128, 128);
  ASSERT_GT(big.max_pairs, schedule::kSmallPlanMaxPairs);
  EXPECT_EQ(
      cudaErrorInvalidValue,
      schedule::build_device_plan(nullptr, nullptr, 4000, 128, 128, nullptr, nullptr, schedule::PlanKey{},
                                  nullptr, big, nullptr, false, schedule::PlanBuilder::kSmall));
}

// A build the offsets check stopped must not leave an older plan's key behind: a later call
// reusing the workspace would otherwise read a plan built for other offsets.
TEST(GpuDevicePlan, FailedBuildClearsTheStoredKey) {
  const std::vector<int32_t> q_off = {0, 5, 9};
  const schedule::DevicePlanLayout layout = schedule::DevicePlanLayout::make(0, 2, 9, 9, 128, 128);
  DeviceBuffer d_q = DeviceBuffer::from_host(q_off);
  DeviceBuffer flag = DeviceBuffer::from_host(std::vector<int32_t>{1});  // the offsets check failed
  DeviceBuffer workspace(layout.total_bytes);
  const schedule::PlanKey key = schedule::plan_key({128, 128}, 2, 9, 9);
  DeviceBuffer stored_key = DeviceBuffer::from_host(std::vector<schedule::PlanKey>{key});  // an older build's
  ASSERT_EQ(cudaSuccess, schedule::build_device_plan(d_q.as<int32_t>(), d_q.as<int32_t>(), 2, 128, 128,
                                                     flag.as<int32_t>(), stored_key.as<schedule::PlanKey>(),
                                                     key, workspace.get(), layout, nullptr));
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  schedule::PlanKey stored{};
  stored_key.to_host(&stored);
  EXPECT_FALSE(schedule::same_plan_key(stored, key));
  EXPECT_EQ(stored.tag_and_tiles, 0);
}

// With a block-sparse map the plan weighs each sequence by its map's visible blocks (not its
// q blocks x kv blocks): the pairs come heaviest map first (ties: lower batch), each sequence's
// pairs together and all of them, from both builders, for the forward's pairs (map rows) and
// the backward's (by_column: map columns, the plan's "q" side the keys).
TEST(GpuDevicePlan, WeighsSequencesByTheirMapsVisibleBlocks) {
  uint64_t state = 777;
  auto next = [&state](uint32_t bound) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int32_t>((state >> 33) % bound);
  };
  const std::vector<int32_t> len_q = {300, 0, 1, 1000, 129, 640, 128, 2000};
  const std::vector<int32_t> len_kv = {500, 7, 0, 1000, 257, 100, 128, 1500};
  const auto batch = static_cast<int32_t>(len_q.size());
  std::vector<int32_t> map_off = {0};
  std::vector<uint8_t> map;
  std::vector<uint64_t> visible(batch, 0);
  for (int32_t b = 0; b < batch; ++b) {
    const int64_t entries = BlockMask::entries(len_q[b], len_kv[b]);
    // Densities from 0 to 1 across the batch, so the map's order differs from the shapes' order.
    const int32_t density = (b * 37) % 11;
    for (int64_t e = 0; e < entries; ++e) {
      const uint8_t v = next(10) < density ? static_cast<uint8_t>(1 + next(255)) : 0;
      map.push_back(v);
      visible[b] += v != 0;
    }
    map_off.push_back(static_cast<int32_t>(map.size()));
  }
  if (map.empty()) map.push_back(0);
  DeviceBuffer d_map = DeviceBuffer::from_host(map), d_map_off = DeviceBuffer::from_host(map_off);
  for (bool by_column : {false, true}) {
    // The backward's plan runs over the keys: its "q" side is kv.
    const std::vector<int32_t>& side_q = by_column ? len_kv : len_q;
    const std::vector<int32_t>& side_kv = by_column ? len_q : len_kv;
    const std::vector<int32_t> q_off = test::offsets_from_lengths(side_q),
                               kv_off = test::offsets_from_lengths(side_kv);
    constexpr int kTileM = BlockMask::kBlock, kTileN = 64;
    const schedule::DevicePlanLayout layout =
        schedule::DevicePlanLayout::make(0, batch, q_off.back(), kv_off.back(), kTileM, kTileN, true);
    DeviceBuffer d_q = DeviceBuffer::from_host(q_off), d_kv = DeviceBuffer::from_host(kv_off);
    DeviceBuffer flag = DeviceBuffer::from_host(std::vector<int32_t>{0});
    const schedule::PlanKey key = schedule::plan_key({kTileM, kTileN}, batch, q_off.back(), kv_off.back());
    schedule::SequenceMap seq_map{};
    seq_map.block_mask.blocks = d_map.as<uint8_t>();
    seq_map.block_mask.offsets = d_map_off.as<int32_t>();
    seq_map.by_column = by_column;
    for (schedule::PlanBuilder builder : {schedule::PlanBuilder::kSmall, schedule::PlanBuilder::kLarge}) {
      SCOPED_TRACE(std::string(by_column ? "by column" : "by row") +
                   (builder == schedule::PlanBuilder::kSmall ? ", small builder" : ", large builder"));
      DeviceBuffer workspace(layout.total_bytes);
      ASSERT_EQ(cudaSuccess, cudaMemset(workspace.get(), 0x5a, layout.total_bytes));
      DeviceBuffer stored_key = DeviceBuffer::from_host(std::vector<schedule::PlanKey>{schedule::PlanKey{}});
      ASSERT_EQ(cudaSuccess,
                schedule::build_device_plan(d_q.as<int32_t>(), d_kv.as<int32_t>(), batch, kTileM, kTileN,
                                            flag.as<int32_t>(), stored_key.as<schedule::PlanKey>(), key,
                                            workspace.get(), layout, nullptr, false, builder, seq_map));
      ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
      std::vector<char> ws(layout.total_bytes);
      workspace.to_host(ws.data());
      auto ints = [&](size_t offset) { return reinterpret_cast<const int32_t*>(ws.data() + offset); };
      const int32_t pairs = *ints(layout.num_pairs);
      int32_t expected_pairs = 0;
      for (int32_t b = 0; b < batch; ++b) expected_pairs += (side_q[b] + kTileM - 1) / kTileM;
      ASSERT_EQ(pairs, expected_pairs);
      const auto* keys = reinterpret_cast<const uint64_t*>(ws.data() + layout.keys_out);
      std::vector<int32_t> seen_pairs(batch, 0);
      int32_t previous_batch = -1;
      std::vector<bool> finished(batch, false);
      for (int32_t i = 0; i < pairs; ++i) {
        const int32_t pair = ints(layout.vals_out)[i];
        ASSERT_GE(pair, 0);
        ASSERT_LT(pair, pairs);
        const int32_t b = ints(layout.pair_batch)[pair];
        ASSERT_EQ(keys[i], ((visible[b] + 1) << layout.batch_bits) | static_cast<uint64_t>(batch - 1 - b))
            << "position " << i << ": the key carries the map's visible blocks of sequence " << b;
        if (b != previous_batch) {
          ASSERT_FALSE(finished[b]) << "sequence " << b << "'s pairs are not together";
          if (previous_batch >= 0) {
            finished[previous_batch] = true;
            const bool heavier = visible[previous_batch] > visible[b] ||
                                 (visible[previous_batch] == visible[b] && previous_batch < b);
            ASSERT_TRUE(heavier) << "sequence " << previous_batch << " (" << visible[previous_batch]
                                 << " visible) before " << b << " (" << visible[b] << ")";
          }
          previous_batch = b;
        }
        ++seen_pairs[b];
      }
      for (int32_t b = 0; b < batch; ++b) EXPECT_EQ(seen_pairs[b], (side_q[b] + kTileM - 1) / kTileM);
    }
  }
  // A map needs its room in the layout and map-sized pairs.
  const std::vector<int32_t> off = {0, 256};
  DeviceBuffer d_off = DeviceBuffer::from_host(off);
  schedule::SequenceMap seq_map{};
  seq_map.block_mask.blocks = d_map.as<uint8_t>();
  seq_map.block_mask.offsets = d_map_off.as<int32_t>();
  const schedule::DevicePlanLayout no_room = schedule::DevicePlanLayout::make(0, 1, 256, 256, 128, 128);
  EXPECT_EQ(cudaErrorInvalidValue,
            schedule::build_device_plan(d_off.as<int32_t>(), d_off.as<int32_t>(), 1, 128, 128, nullptr,
                                        nullptr, schedule::PlanKey{}, nullptr, no_room, nullptr, false,
                                        schedule::PlanBuilder::kAuto, seq_map));
  const schedule::DevicePlanLayout small_tiles =
      schedule::DevicePlanLayout::make(0, 1, 256, 256, 64, 128, true);
  EXPECT_EQ(cudaErrorInvalidValue,
            schedule::build_device_plan(d_off.as<int32_t>(), d_off.as<int32_t>(), 1, 64, 128, nullptr,
                                        nullptr, schedule::PlanKey{}, nullptr, small_tiles, nullptr, false,
                                        schedule::PlanBuilder::kAuto, seq_map));
}

}  // namespace
}  // namespace jagflash
