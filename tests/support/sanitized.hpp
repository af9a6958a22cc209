// Whether a test runs under AddressSanitizer: a few long tests do less there (the normal
// build, which CI also runs, does all of it). GCC defines __SANITIZE_ADDRESS__; Clang 14
// does not, it answers __has_feature(address_sanitizer).
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define KVTEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVTEST_SANITIZED 1
#endif
#endif
#ifndef KVTEST_SANITIZED
#define KVTEST_SANITIZED 0
#endif

namespace kvtest {
inline constexpr bool sanitized = KVTEST_SANITIZED != 0;
}  // namespace kvtest
