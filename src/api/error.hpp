// Errors inside the library: thrown as ApiError, turned into a jf_status and a thread-local
// message at the C boundary (c_api.cpp). Nothing throws across that boundary.
#pragma once

#include <jagflash/jagflash.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace jagflash::detail {

class ApiError : public std::runtime_error {
 public:
  ApiError(jf_status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  jf_status status() const { return status_; }

 private:
  jf_status status_;
};

void set_last_error(const std::string& message);

// "argument: expected X, got Y" — the one shape every validation message has.
template <typename Expected, typename Given>
[[noreturn]] void fail_argument(const std::string& argument, const Expected& expected, const Given& given,
                                jf_status status = JF_ERR_INVALID_ARGUMENT) {
  std::ostringstream s;
  s << argument << ": expected " << expected << ", got " << given;
  throw ApiError(status, s.str());
}

[[noreturn]] inline void fail_cuda(const char* what, int code, const char* name) {
  std::ostringstream s;
  s << "CUDA error in " << what << ": " << name << " (" << code << ")";
  throw ApiError(JF_ERR_CUDA, s.str());
}

}  // namespace jagflash::detail

// Every CUDA runtime call in the library goes through this.
#define JF_CUDA_CHECK(call)                                                                         \
  do {                                                                                              \
    const cudaError_t jf_err_ = (call);                                                             \
    if (jf_err_ != cudaSuccess)                                                                     \
      ::jagflash::detail::fail_cuda(#call, static_cast<int>(jf_err_), cudaGetErrorString(jf_err_)); \
  } while (0)
