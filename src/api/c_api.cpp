// The C boundary: every entry point runs inside guarded(), which turns exceptions into a status
// and the thread-local message. Nothing throws past this file.
#include <jagflash/jagflash.h>

#include "api/device_error.hpp"
#include "api/dispatch.hpp"
#include "api/error.hpp"
#include "api/validate.hpp"
#include "core/score_mod.hpp"
#include "kernels/hopper_backward.hpp"
#include "kernels/hopper_forward.hpp"

#include <cuda_runtime.h>

#include <cstring>
#include <new>
#include <string>

namespace jagflash::detail {
namespace {
thread_local std::string g_last_error;

// Every entry point: one call's pointer-location answers are shared by all its checks (a call
// validates its shapes twice: once for the workspace size, once for itself).
template <typename F>
jf_status guarded(F&& f) {
  try {
    const PointerLocationScope locations;
    f();
    g_last_error.clear();
    return JF_OK;
  } catch (const ApiError& e) {
    g_last_error = e.what();
    return e.status();
  } catch (const std::bad_alloc&) {
    g_last_error = "out of host memory";
    return JF_ERR_INTERNAL;
  } catch (const std::exception& e) {
    g_last_error = std::string("internal error: ") + e.what();
    return JF_ERR_INTERNAL;
  } catch (...) {
    g_last_error = "internal error: unknown exception";
    return JF_ERR_INTERNAL;
  }
}

template <typename T>
void require_non_null(const char* name, const T* p) {
  if (p == nullptr) fail_argument(name, "a non-null pointer", "NULL");
}
}  // namespace

void set_last_error(const std::string& message) { g_last_error = message; }

}  // namespace jagflash::detail

using jagflash::detail::guarded;
using jagflash::detail::require_non_null;

namespace {
// A query's direction, read as an int: a C caller may pass any int, which C++ must not load
// through the enum. Anything but the two directions is refused, naming the argument.
bool is_backward(jf_direction direction) {
  int dir = 0;
  static_assert(sizeof dir == sizeof direction, "the jf_* enums are int-sized");
  std::memcpy(&dir, &direction, sizeof dir);
  if (dir != JF_DIRECTION_FORWARD && dir != JF_DIRECTION_BACKWARD)
    jagflash::detail::fail_argument("direction", "JF_DIRECTION_FORWARD or JF_DIRECTION_BACKWARD", dir);
  return dir == JF_DIRECTION_BACKWARD;
}

// An enum argument read as an int (as is_backward reads the direction): the value, refused naming
// the argument unless `known` holds it.
template <typename Enum, typename Known>
Enum checked_enum(const char* name, Enum value, const char* expected, Known&& known) {
  int v = 0;
  static_assert(sizeof v == sizeof value, "the jf_* enums are int-sized");
  std::memcpy(&v, &value, sizeof v);
  if (!known(v)) jagflash::detail::fail_argument(name, expected, v);
  return value;
}
}  // namespace

extern "C" {

const char* jagflash_version(void) { return JAGFLASH_VERSION_STRING; }

int jagflash_version_number(void) {
  return JAGFLASH_VERSION_MAJOR * 10000 + JAGFLASH_VERSION_MINOR * 100 + JAGFLASH_VERSION_PATCH;
}

const char* jagflash_last_error(void) { return jagflash::detail::g_last_error.c_str(); }

jf_status jagflash_fwd_workspace_size(const jf_fwd_args* args, size_t* bytes) {
  return guarded([&] {
    require_non_null("args", args);
    require_non_null("bytes", bytes);
    *bytes = jagflash::detail::forward_workspace_size(*args);
  });
}

jf_status jagflash_fwd(const jf_fwd_args* args) {
  return guarded([&] {
    require_non_null("args", args);
    jagflash::detail::run_forward(*args);
  });
}

jf_status jagflash_bwd_workspace_size(const jf_bwd_args* args, size_t* bytes) {
  return guarded([&] {
    require_non_null("args", args);
    require_non_null("bytes", bytes);
    *bytes = jagflash::detail::backward_workspace_size(*args);
  });
}

jf_status jagflash_bwd(const jf_bwd_args* args) {
  return guarded([&] {
    require_non_null("args", args);
    jagflash::detail::run_backward(*args);
  });
}

jf_status jagflash_query_backend(const jf_problem* problem, const jf_launch* launch, jf_direction direction,
                                 jf_backend* served) {
  return guarded([&] {
    require_non_null("problem", problem);
    require_non_null("launch", launch);
    require_non_null("served", served);
    *served = jagflash::detail::query_backend(*problem, *launch, is_backward(direction));
  });
}

jf_status jagflash_query_kernel(const jf_problem* problem, const jf_launch* launch, jf_direction direction,
                                jf_backend* served, int32_t* kernel_head_dim) {
  return guarded([&] {
    require_non_null("problem", problem);
    require_non_null("launch", launch);
    require_non_null("served", served);
    require_non_null("kernel_head_dim", kernel_head_dim);
    int32_t head_dim = 0;
    const jf_backend b =
        jagflash::detail::query_backend(*problem, *launch, is_backward(direction), &head_dim);
    *served = b;  // written only on success, as jagflash_query_backend's
    *kernel_head_dim = head_dim;
  });
}

jf_status jagflash_hopper_kernel(jf_direction direction, jf_dtype dtype, int32_t head_dim, int32_t v_head_dim,
                                 jf_score_mod score_mod, int32_t block_sparse, int32_t* kernel_head_dim) {
  return guarded([&] {
    require_non_null("kernel_head_dim", kernel_head_dim);
    const bool backward = is_backward(direction);
    checked_enum("dtype", dtype, "JF_BF16, JF_FP16 or JF_FP32",
                 [](int v) { return v == JF_BF16 || v == JF_FP16 || v == JF_FP32; });
    checked_enum("score_mod", score_mod, "a jf_score_mod", [](int v) {
      bool found = false;
      jagflash::ScoreModTypes::for_each([&](auto mod) { found = found || decltype(mod)::kKind == v; });
      return found;
    });
    const bool sparse = block_sparse != 0;
    int32_t found = 0;
    if (backward) {
      if (const auto* e =
              jagflash::kernels::find_hopper_backward(dtype, head_dim, score_mod, sparse, v_head_dim))
        found = e->head_dim;
    } else if (const auto* e =
                   jagflash::kernels::find_hopper_forward(dtype, head_dim, score_mod, sparse, v_head_dim)) {
      found = e->head_dim;
    }
    *kernel_head_dim = found;
  });
}

const char* jagflash_backend_name(jf_backend backend) {
  int value = 0;
  std::memcpy(&value, &backend, sizeof value);
  switch (value) {
    case JF_BACKEND_AUTO:
      return "auto";
    case JF_BACKEND_REFERENCE:
      return "reference";
    case JF_BACKEND_ORACLE:
      return "oracle";
    case JF_BACKEND_HOPPER:
      return "hopper";
    default:
      return "unknown";
  }
}

jf_status jagflash_read_device_error(const void* workspace, void* stream) {
  return guarded([&] { jagflash::detail::read_device_error(workspace, stream); });
}

jf_status jagflash_synchronize(void* stream) {
  return guarded([&] {
    if (jagflash_cuda_device_count() == 0) return;
    JF_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
    int device = 0;
    JF_CUDA_CHECK(cudaGetDevice(&device));
    jagflash::detail::report_latched_device_error(device);
  });
}

jf_status jagflash_score_mod_by_name(const char* name, jf_score_mod* kind) {
  return guarded([&] {
    require_non_null("name", name);
    require_non_null("kind", kind);
    std::string known;
    bool found = false;
    jagflash::ScoreModTypes::for_each([&](auto mod) {
      using Mod = decltype(mod);
      if (!found && std::strcmp(Mod::kName, name) == 0) {
        *kind = Mod::kKind;
        found = true;
      }
      known += (known.empty() ? "\"" : ", \"") + std::string(Mod::kName) + "\"";
    });
    if (found) return;
    jagflash::detail::fail_argument("name", "the name of a score modifier (" + known + ")",
                                    std::string("\"") + name + "\"");
  });
}

int jagflash_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

}  // extern "C"
