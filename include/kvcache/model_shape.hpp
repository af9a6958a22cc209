// kvcache: the model shape a cache is built for, and its validation.
#pragma once

#include <cmath>    // std::isfinite
#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers
#include <limits>   // overflow checks
#include <string>   // messages

#include "error.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Token position (RoPE position). -1 marks an empty cell.
using pos_t = std::int32_t;
/// Sequence id in [0, n_seq_max). Negative ids mean "every sequence" where allowed.
using seq_id_t = std::int32_t;

/// How RoPE pairs the dimensions of a head.
enum class rope_type : std::uint8_t {
    normal = 0,  ///< pairs (2i, 2i+1)          (GPT-J / llama.cpp "normal")
    neox = 1,    ///< pairs (i, i + n_rot / 2)  (GPT-NeoX, Llama in HF layout)
};

/// RoPE parameters: theta_i = pos * freq_scale * freq_base^(-2i / n_rot).
struct rope_params {
    rope_type type = rope_type::normal;
    float freq_base = 10000.0f;
    float freq_scale = 1.0f;
    std::uint32_t n_rot = 0;  ///< rotated dimensions per head (even); 0 means head_dim_k
};

/// Shape of the cache: what the model needs per token and how many cells to hold.
struct model_shape {
    std::uint32_t n_layer = 0;      ///< layers with a KV cache
    std::uint32_t n_head_kv = 0;    ///< KV heads per layer (GQA: fewer than query heads)
    std::uint32_t head_dim_k = 0;   ///< K dimension per head
    std::uint32_t head_dim_v = 0;   ///< V dimension per head (0 means head_dim_k)
    rope_params rope{};             ///< used by RoPE and the K-shift
    std::uint32_t n_cells = 0;      ///< capacity in token cells
    std::uint32_t n_seq_max = 1;    ///< sequence ids are in [0, n_seq_max)

    /// Limits accepted by validate().
    static constexpr std::uint32_t max_layers = 4096;
    static constexpr std::uint32_t max_heads = 4096;
    static constexpr std::uint32_t max_head_dim = 4096;
    static constexpr std::uint32_t max_cells = 1u << 30;

    [[nodiscard]] std::uint32_t dim_k() const noexcept { return head_dim_k; }
    [[nodiscard]] std::uint32_t dim_v() const noexcept { return head_dim_v == 0 ? head_dim_k : head_dim_v; }
    [[nodiscard]] std::uint32_t n_rot() const noexcept { return rope.n_rot == 0 ? head_dim_k : rope.n_rot; }
    /// Floats in one cell's K row of one layer (all KV heads).
    [[nodiscard]] std::size_t k_row_size() const noexcept { return std::size_t{n_head_kv} * dim_k(); }
    /// Floats in one cell's V row of one layer (all KV heads).
    [[nodiscard]] std::size_t v_row_size() const noexcept { return std::size_t{n_head_kv} * dim_v(); }

    /// Bytes one token occupies across all layers: (dim_k + dim_v) x n_head_kv x n_layer x elem_size.
    [[nodiscard]] std::size_t bytes_per_token(std::size_t elem_size) const noexcept {
        return (k_row_size() + v_row_size()) * n_layer * elem_size;
    }

    /// Throws kvcache::error(invalid_config) naming the first bad parameter and its value.
    void validate() const {
        auto bad = [](const char* name, const std::string& value, const char* why) {
            detail::fail(errc::invalid_config,
                         std::string("model_shape.") + name + " = " + value + ": " + why);
        };
        using std::to_string;
        if (n_layer == 0 || n_layer > max_layers)
            bad("n_layer", to_string(n_layer), "must be in [1, 4096]");
        if (n_head_kv == 0 || n_head_kv > max_heads)
            bad("n_head_kv", to_string(n_head_kv), "must be in [1, 4096]");
        if (head_dim_k == 0 || head_dim_k > max_head_dim)
            bad("head_dim_k", to_string(head_dim_k), "must be in [1, 4096]");
        if (head_dim_v > max_head_dim)
            bad("head_dim_v", to_string(head_dim_v), "must be in [0, 4096] (0 means head_dim_k)");
        if (rope.n_rot > head_dim_k)
            bad("rope.n_rot", to_string(rope.n_rot), "must not exceed head_dim_k");
        if (n_rot() % 2 != 0)
            bad("rope.n_rot", to_string(n_rot()), "must be even (RoPE rotates pairs)");
        if (!(std::isfinite(rope.freq_base) && rope.freq_base > 0.0f))
            bad("rope.freq_base", std::to_string(rope.freq_base), "must be finite and > 0");
        if (!(std::isfinite(rope.freq_scale) && rope.freq_scale > 0.0f))
            bad("rope.freq_scale", std::to_string(rope.freq_scale), "must be finite and > 0");
        if (rope.type != rope_type::normal && rope.type != rope_type::neox)
            bad("rope.type", to_string(static_cast<int>(rope.type)), "must be normal or neox");
        if (n_cells == 0 || n_cells > max_cells)
            bad("n_cells", to_string(n_cells), "must be in [1, 2^30]");
        if (n_seq_max == 0 || n_seq_max > KVCACHE_MAX_SEQ)
            bad("n_seq_max", to_string(n_seq_max), "must be in [1, KVCACHE_MAX_SEQ]");
        // Total bytes must fit in size_t with room for padding (8-byte elements at most).
        const long double total = static_cast<long double>(k_row_size() + v_row_size()) * n_layer *
                                  (static_cast<long double>(n_cells) + 256) * 8;
        if (total > static_cast<long double>(std::numeric_limits<std::size_t>::max() / 2))
            bad("n_cells", to_string(n_cells), "total buffer size overflows size_t");
    }
};

KVCACHE_END_NAMESPACE
