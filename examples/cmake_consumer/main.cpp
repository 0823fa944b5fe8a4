// Uses an installed jagflash through its C API: the version, then a forward on CPU pointers (the
// float64 reference) whose result is known in closed form. Exits non-zero on any mismatch.
#include <jagflash/jagflash.h>
#include <jagflash/jagflash.hpp>  // the C++ header must compile against the installed tree too

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

static jf_tensor view(float* data, int64_t rows, int32_t heads, int32_t head_dim) {
  jf_tensor t;
  t.data = data;
  t.rows = rows;
  t.heads = heads;
  t.head_dim = head_dim;
  t.head_stride = head_dim;
  t.row_stride = static_cast<int64_t>(heads) * head_dim;
  return t;
}

int main() {
  std::printf("jagflash %s (%d)\n", jagflash_version(), jagflash_version_number());
  if (std::strcmp(jagflash_version(), "0.1.0") != 0 ||
      jagflash_version_number() !=
          JAGFLASH_VERSION_MAJOR * 10000 + JAGFLASH_VERSION_MINOR * 100 + JAGFLASH_VERSION_PATCH) {
    std::fprintf(stderr, "version mismatch between the header and the library\n");
    return 1;
  }

  // Two sequences (q lengths 2 and 1, kv lengths 3 and 4), one head, head dim 64, fp32.
  // q = 0, so every score is 0: lse = log(Lk) and out is the mean of the sequence's v rows;
  // v[j][d] = d for every row, so out[i][d] = d.
  const int32_t B = 2, H = 1, D = 64;
  const int32_t q_offsets[] = {0, 2, 3};
  const int32_t kv_offsets[] = {0, 3, 7};
  const int64_t tq = 3, tk = 7;
  std::vector<float> q(tq * H * D, 0.f), k(tk * H * D), v(tk * H * D), out(tq * H * D, -1.f),
      lse(H * tq, 0.f);
  for (int64_t i = 0; i < tk * H * D; ++i) {
    k[i] = static_cast<float>((i * 37) % 11) / 11.f - 0.5f;
    v[i] = static_cast<float>(i % D);
  }

  jf_fwd_args args;
  std::memset(&args, 0, sizeof(args));
  args.problem =
      jagflash::make_problem(JF_FP32, JF_DEVICE_CPU, B, q_offsets, kv_offsets, view(q.data(), tq, H, D),
                             view(k.data(), tk, H, D), view(v.data(), tk, H, D));
  args.out = view(out.data(), tq, H, D);
  args.lse = lse.data();
  args.launch.backend = JF_BACKEND_AUTO;

  size_t bytes = 0;
  if (jagflash_fwd_workspace_size(&args, &bytes) != JF_OK) {
    std::fprintf(stderr, "jagflash_fwd_workspace_size: %s\n", jagflash_last_error());
    return 1;
  }
  std::vector<unsigned char> workspace(bytes ? bytes : 1);
  args.launch.workspace = workspace.data();
  args.launch.workspace_bytes = bytes;
  const jf_status status = jagflash_fwd(&args);
  if (status != JF_OK) {
    std::fprintf(stderr, "jagflash_fwd: status %d: %s\n", static_cast<int>(status), jagflash_last_error());
    return 1;
  }

  int bad = 0;
  for (int64_t i = 0; i < tq; ++i) {
    const int32_t lk = i < 2 ? 3 : 4;
    if (std::fabs(lse[i] - std::log(static_cast<float>(lk))) > 1e-5f) ++bad;
    for (int32_t d = 0; d < D; ++d)
      if (std::fabs(out[i * D + d] - static_cast<float>(d)) > 1e-4f) ++bad;
  }
  // A malformed call must fail with a status and a message, not crash.
  jf_fwd_args broken = args;
  broken.problem.batch_size = -1;
  if (jagflash_fwd(&broken) != JF_ERR_INVALID_ARGUMENT || std::strlen(jagflash_last_error()) == 0) ++bad;
  if (bad) {
    std::fprintf(stderr, "jagflash_fwd on the CPU: %d wrong values\n", bad);
    return 1;
  }
  std::printf("jagflash_fwd on the CPU: out and lse as expected\n");
  return 0;
}
