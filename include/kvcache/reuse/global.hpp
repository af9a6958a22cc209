// kvcache: the "global" reuse policy (F21): a slot's state is saved into a
// cross-slot prompt cache when the slot is released, and a request may load the
// best cached entry instead of the slot's own state.
#pragma once

#include <string_view>  // name

#include "../concepts.hpp"
#include "../tokens/prompt_tokens.hpp"
#include "eviction.hpp"
#include "lcp.hpp"
#include "plan.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace reuse {

/// Global prompt cache on top of a per-slot policy Base (lcp, chunk_shift<N> or a custom
/// one), with eviction order Eviction (evict_lru, evict_lfu, evict_priority or a custom
/// one). Plans are Base's, made against the tokens of the state the slot starts from (its
/// own or the selected global entry).
template <class Base = lcp, class Eviction = evict_lru>
struct global {
    static_assert(reuse_policy<Base>,
                  "kvcache: reuse::global's Base does not satisfy kvcache::reuse_policy (see kvcache/concepts.hpp)");
    static_assert(eviction_policy<Eviction>,
                  "kvcache: reuse::global's Eviction does not satisfy kvcache::eviction_policy (see kvcache/concepts.hpp)");
    static_assert(!Base::global_cache, "kvcache: reuse::global's Base must be a per-slot policy (lcp or chunk_shift<N>)");
    using policy_kind = reuse_tag;
    using base = Base;
    using eviction = Eviction;
    static constexpr std::string_view name = "global";
    static constexpr bool needs_shift = Base::needs_shift;
    static constexpr bool global_cache = true;

    /// Base's plan.
    reuse::plan plan(const prompt_tokens& cached, const prompt_tokens& request, const plan_options& opt) {
        return base_.plan(cached, request, opt);
    }
    /// The Base policy object (its state, for a stateful custom Base).
    [[nodiscard]] Base& base_policy() noexcept { return base_; }

private:
    [[no_unique_address]] Base base_{};
};

/// Eviction order of reuse policy R's global cache: R::eviction if R::global_cache, else
/// evict_lru (unused: no global cache).
template <class R, bool Global = R::global_cache>
struct eviction_of {
    using type = evict_lru;
};
template <class R>
struct eviction_of<R, true> {
    using type = typename R::eviction;
};

}  // namespace reuse
KVCACHE_END_NAMESPACE
