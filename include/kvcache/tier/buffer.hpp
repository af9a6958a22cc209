// kvcache tier: blob buffers. A tier's get() and the memory tier's entries hold whole
// blobs (megabytes per entry); a new buffer of that size is touched page by page, and
// where a page fault is dear (virtual machines: measured 0.17 GB/s into fresh 4 KiB pages
// against 14 GB/s warm on the 2-core Zen 5 VM, bench/README.md) that first touch costs
// more than the copy itself. resize_blob_buffer advises transparent huge pages for the
// 2 MiB-aligned interior of a new allocation before the first touch (one fault per 2 MiB;
// the same advice as the K/V buffers, layout/kv_storage.hpp).
#pragma once

#include <cstddef>  // std::byte, std::size_t
#include <cstdint>  // std::uintptr_t
#include <vector>   // blob buffers

#include "../layout/kv_storage.hpp"  // huge_page_bytes, detail::advise_huge_pages

KVCACHE_BEGIN_NAMESPACE
namespace detail {

/// Makes v hold n bytes, about to be overwritten whole (its old contents are dropped
/// when it has to grow). A growth to two huge pages or more allocates anew and advises
/// huge pages for the new buffer's 2 MiB-aligned interior before it is touched.
inline void resize_blob_buffer(std::vector<std::byte>& v, std::size_t n) {
    if (n > v.capacity() && n >= 2 * huge_page_bytes) {
        std::vector<std::byte> fresh;
        fresh.reserve(n);  // allocated, not yet touched
        const auto b = reinterpret_cast<std::uintptr_t>(fresh.data());
        const std::uintptr_t a = (b + huge_page_bytes - 1) & ~(std::uintptr_t{huge_page_bytes} - 1);
        if (a < b + n) static_cast<void>(advise_huge_pages(reinterpret_cast<void*>(a), b + n - a));
        v.swap(fresh);
    }
    v.resize(n);
}

}  // namespace detail
KVCACHE_END_NAMESPACE
