// kvcache: the contiguous layout (llama.cpp's "unified" cache).
//
// One buffer per layer for K and one for V, indexed by cell; any free cell can
// take any token of any sequence; attention reads cells [0, n) (F8) and masks by
// sequence and position.
#pragma once

#include <cstdint>      // std::uint32_t
#include <string_view>  // name

#include "../concepts.hpp"
#include "kv_storage.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Contiguous layout policy. VLayout picks row-major (default) or transposed V (F9).
template <v_layout VLayout = v_layout::row_major>
struct contiguous {
    using policy_kind = layout_tag;
    static constexpr std::string_view name =
        VLayout == v_layout::row_major ? std::string_view("contiguous") : std::string_view("contiguous_vt");
    static constexpr std::uint32_t layout_id = VLayout == v_layout::row_major ? 0u : 1u;
    static constexpr bool can_shift = true;
    static constexpr v_layout v_arrangement = VLayout;

    template <class Element>
    using storage = tiled_kv_storage<Element, VLayout>;
};

KVCACHE_END_NAMESPACE
