// xxHash stays inside io/ (io/detail/xxhash.hpp): after the umbrella header, its
// configuration macros are not defined in user code.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#if defined(XXH_INLINE_ALL)
#error "kvcache leaks XXH_INLINE_ALL"
#endif
#if defined(XXH_VECTOR)
#error "kvcache leaks XXH_VECTOR"
#endif

TEST_CASE("xxhash: XXH_INLINE_ALL and XXH_VECTOR are not defined after kvcache/kvcache.hpp") {
#if defined(XXH_INLINE_ALL) || defined(XXH_VECTOR)
    CHECK(false);
#else
    CHECK(true);
#endif
    const std::byte b[3] = {std::byte{1}, std::byte{2}, std::byte{3}};
    CHECK(kvcache::io::checksum(b) != 0);  // the checksum still works through the io wrapper
}
