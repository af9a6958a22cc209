// kvcache: eviction orders of the global prompt cache (F21).
//
// An eviction policy ranks entries; the entry with the smallest rank is evicted
// first. Pinned entries are never ranked (never evicted).
//
// The eviction_policy concept (its required members) is in kvcache/concepts.hpp.
#pragma once

#include <cstdint>      // fixed-width integers
#include <string_view>  // name

#include "../concepts.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What the prompt cache knows about an entry when ranking it.
struct entry_stats {
    std::uint64_t last_use = 0;  ///< logical clock of the last insert or hit (larger = more recent)
    std::uint64_t hits = 0;      ///< lookups that selected this entry
    std::int32_t priority = 0;   ///< host-given priority (larger = kept longer)
};

namespace reuse {

/// Least recently used first (llama-server's order; the default).
struct evict_lru {
    static constexpr std::string_view name = "lru";
    static eviction_rank rank(const entry_stats& s) noexcept { return {s.last_use, 0}; }
};

/// Least frequently used first; ties by least recently used.
struct evict_lfu {
    static constexpr std::string_view name = "lfu";
    static eviction_rank rank(const entry_stats& s) noexcept { return {s.hits, s.last_use}; }
};

/// Lowest priority first; ties by least recently used.
struct evict_priority {
    static constexpr std::string_view name = "priority";
    static eviction_rank rank(const entry_stats& s) noexcept {
        return {static_cast<std::uint64_t>(static_cast<std::int64_t>(s.priority) + (std::int64_t{1} << 31)), s.last_use};
    }
};

}  // namespace reuse
KVCACHE_END_NAMESPACE
