// kvcache: eviction orders of the global prompt cache (F21).
//
// An eviction policy ranks entries; the entry with the smallest rank is evicted
// first. Pinned entries are never ranked (never evicted).
//
// Required members of an eviction policy E:
//   1. static constexpr std::string_view name;
//   2. static eviction_rank rank(const entry_stats&) noexcept;   smaller = evicted sooner
#pragma once

#include <concepts>     // std::same_as
#include <cstdint>      // fixed-width integers
#include <string_view>  // name
#include <utility>      // std::pair

#include "../config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What the prompt cache knows about an entry when ranking it.
struct entry_stats {
    std::uint64_t last_use = 0;  ///< logical clock of the last insert or hit (larger = more recent)
    std::uint64_t hits = 0;      ///< lookups that selected this entry
    std::int32_t priority = 0;   ///< host-given priority (larger = kept longer)
};

/// Eviction rank: entries are evicted in increasing (first, second) order.
using eviction_rank = std::pair<std::uint64_t, std::uint64_t>;

template <class E>
concept eviction_policy = requires(const entry_stats& s) {
    { E::name } -> std::convertible_to<std::string_view>;
    { E::rank(s) } noexcept -> std::same_as<eviction_rank>;
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
