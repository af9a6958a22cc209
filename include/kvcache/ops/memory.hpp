// kvcache ops: memory accounting per layout (bytes reserved, in use, held, wasted).
//
// - reserved: every K/V buffer the cache allocated (F2: all of it, once).
// - used:     occupied cells x bytes per token (a cell shared by several sequences
//             counts once).
// - held:     cells no other sequence can take right now, x bytes per token:
//             contiguous: the occupied cells (any free cell takes any token);
//             paged:      every referenced block in full (free cells of a block belong
//                         to the sequences using it);
//             ring:       the whole region of every region that holds a cell (its own
//                         sequence's or, until the next commit moves it, another's), plus
//                         the occupied cells past the last region (n_cells not a multiple
//                         of n_seq_max; split copies land there only when every region is
//                         full), so held >= used.
// - waste = held - used: memory lost to the layout's granularity (vLLM's "< 4%"
//   for paged blocks is this number).
// A composite memory (iswa_cache) reports the sum of its parts.
#pragma once

#include <cstddef>  // std::size_t
#include <cstdint>  // std::uint64_t

#include "../config.hpp"
#include "../layout/capabilities.hpp"
#include "../memory/memory.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops {

/// Memory of one cache, in bytes (see the file comment for the definitions).
struct memory_usage {
    std::size_t reserved_bytes = 0;
    std::size_t used_bytes = 0;
    std::size_t held_bytes = 0;

    /// held - used.
    [[nodiscard]] std::size_t waste_bytes() const noexcept { return held_bytes - used_bytes; }
    /// waste / held (0 when nothing is held).
    [[nodiscard]] double waste_fraction() const noexcept {
        return held_bytes == 0 ? 0.0 : static_cast<double>(waste_bytes()) / static_cast<double>(held_bytes);
    }
};

namespace detail_mem {
/// Memory accounting of one K/V cache; layouts report held cells through storage().held_cells().
template <class Cache>
memory_usage part_memory(const Cache& cache) {
    memory_usage m;
    m.reserved_bytes = cache.total_bytes();
    m.used_bytes = std::size_t{cache.used()} * cache.bytes_per_token();
    std::uint64_t held = cache.used();
    if constexpr (cache_has_capability<Cache, layout_caps::held_cells>())
        held = cache.storage().held_cells(cache.cells());
    m.held_bytes = static_cast<std::size_t>(held) * cache.bytes_per_token();
    return m;
}
}  // namespace detail_mem

/// Memory accounting of a memory: of its one K/V cache, or the sum over the parts of a
/// composite memory (iswa_cache: the full cache plus the ring). Layouts report held
/// cells through storage().held_cells().
template <class Memory>
[[nodiscard]] memory_usage memory(const Memory& mem) {
    static_assert(kvcache::memory<Memory>, "kvcache: ops::memory needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    static_assert(kv_memory<Memory> || composite_memory<Memory>,
                  "kvcache: ops::memory needs a kvcache::kv_memory or a kvcache::composite_memory of them");
    if constexpr (composite_memory<Memory>) {
        memory_usage sum;
        mem.for_each_part([&](const auto& part) {
            const memory_usage m = detail_mem::part_memory(part);
            sum.reserved_bytes += m.reserved_bytes;
            sum.used_bytes += m.used_bytes;
            sum.held_bytes += m.held_bytes;
        });
        return sum;
    } else {
        return detail_mem::part_memory(mem);
    }
}

}  // namespace ops
KVCACHE_END_NAMESPACE
