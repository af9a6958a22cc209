// kvcache: the "global" reuse policy (F21): a slot's state is saved into a
// cross-slot prompt cache when the slot is released, and a request may load the
// best cached entry instead of the slot's own state.
#pragma once

#include <cstdint>      // std::uint32_t
#include <string_view>  // name
#include <type_traits>  // std::is_same_v

#include "../concepts.hpp"
#include "eviction.hpp"
#include "lcp.hpp"
#include "none.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace reuse {

/// Global prompt cache on top of a per-slot policy Base (lcp or chunk_shift<N>), with
/// eviction order Eviction (evict_lru, evict_lfu, evict_priority or a custom one).
template <class Base = lcp, class Eviction = evict_lru>
struct global {
    static_assert(eviction_policy<Eviction>,
                  "kvcache: reuse::global's Eviction does not satisfy kvcache::eviction_policy (see reuse/eviction.hpp)");
    static_assert(!Base::global_cache, "kvcache: reuse::global's Base must be a per-slot policy (lcp or chunk_shift<N>)");
    using policy_kind = reuse_tag;
    using base = Base;
    using eviction = Eviction;
    static constexpr std::string_view name = "global";
    static constexpr bool needs_shift = Base::needs_shift;
    static constexpr std::uint32_t min_chunk = Base::min_chunk;
    static constexpr bool global_cache = true;
};

/// What a slot manager needs from a reuse policy; members that reuse::none (or a custom
/// policy) leaves out take the "reuse nothing" value.
template <class R>
struct reuse_traits {
    static constexpr bool enabled = !std::is_same_v<R, none>;
    static constexpr std::uint32_t min_chunk = [] {
        if constexpr (requires { R::min_chunk; }) return static_cast<std::uint32_t>(R::min_chunk);
        else return std::uint32_t{0};
    }();
    static constexpr bool global_cache = [] {
        if constexpr (requires { R::global_cache; }) return static_cast<bool>(R::global_cache);
        else return false;
    }();
};

/// Eviction order of a reuse policy: R::eviction if it has one, else evict_lru.
template <class R>
struct eviction_of {
    using type = evict_lru;
};
template <class R>
    requires requires { typename R::eviction; }
struct eviction_of<R> {
    using type = typename R::eviction;
};

}  // namespace reuse
KVCACHE_END_NAMESPACE
