// kvcache: picks the policy of each kind out of kv_cache<Policies...>.
#pragma once

#include <type_traits>  // std::conditional_t, std::is_same_v

#include "../concepts.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace detail {

/// Tag that marks kv_cache members meant for library components, not host code.
struct internal_access {
    explicit internal_access() = default;
};

template <class P>
constexpr bool is_known_policy() {
    if constexpr (has_policy_kind<P>) {
        using K = typename P::policy_kind;
        return std::is_same_v<K, element_tag> || std::is_same_v<K, layout_tag> || std::is_same_v<K, reuse_tag>;
    } else {
        return false;
    }
}

template <class Tag, class... Ps>
constexpr int count_kind() {
    return (0 + ... + (policy_of_kind<Ps, Tag> ? 1 : 0));
}

template <class Tag, class Default, class... Ps>
struct select_policy {
    using type = Default;
};
template <class Tag, class Default, class P, class... Ps>
struct select_policy<Tag, Default, P, Ps...> {
    using type = std::conditional_t<policy_of_kind<P, Tag>, P, typename select_policy<Tag, Default, Ps...>::type>;
};

/// The policy of kind Tag among Ps, or Default when none has that kind.
template <class Tag, class Default, class... Ps>
using select_policy_t = typename select_policy<Tag, Default, Ps...>::type;

}  // namespace detail
KVCACHE_END_NAMESPACE
