// kvcache: the model shape a cache is built for, and its validation.
#pragma once

#include <array>    // M-RoPE sections
#include <cmath>    // std::isfinite, std::log, std::sqrt
#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers
#include <initializer_list>  // rope_factors{...}
#include <limits>   // overflow checks
#include <memory>   // std::shared_ptr (rope_factors)
#include <span>     // rope_factors from a span
#include <string>   // messages
#include <vector>   // rope_factors storage

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

/// Per-pair frequency factors (llama.cpp's `rope_freqs`, LongRoPE's short / long tables):
/// n_rot / 2 positive floats, pair i's frequency is divided by entry i. Copies share one
/// immutable array (copying a model_shape copies a pointer); == compares the values.
class rope_factors {
public:
    rope_factors() = default;
    rope_factors(std::initializer_list<float> v) : p_(v.size() ? std::make_shared<const std::vector<float>>(v) : nullptr) {}
    explicit rope_factors(std::span<const float> v)
        : p_(v.empty() ? nullptr : std::make_shared<const std::vector<float>>(v.begin(), v.end())) {}
    [[nodiscard]] std::size_t size() const noexcept { return p_ ? p_->size() : 0; }
    [[nodiscard]] bool empty() const noexcept { return size() == 0; }
    [[nodiscard]] const float* data() const noexcept { return p_ ? p_->data() : nullptr; }
    [[nodiscard]] float operator[](std::size_t i) const noexcept { return (*p_)[i]; }
    friend bool operator==(const rope_factors& a, const rope_factors& b) noexcept {
        if (a.size() != b.size()) return false;
        for (std::size_t i = 0; i < a.size(); ++i)
            if (a[i] != b[i]) return false;
        return true;
    }

private:
    std::shared_ptr<const std::vector<float>> p_;  // null when empty
};

/// Which frequency scaling RoPE uses on top of freq_base, freq_scale and ntk_alpha.
enum class rope_scaling : std::uint8_t {
    none = 0,      ///< plain (linear scaling through freq_scale; freq_factors if given)
    yarn = 1,      ///< YaRN: ramp between interpolation (freq_scale) and extrapolation
    llama3 = 2,    ///< Llama 3.1+: per-frequency factors from rope.llama3
    longrope = 3,  ///< LongRoPE / "su" (Phi-3): short_factors below n_ctx_orig, long_factors from it
};

/// YaRN parameters (rope.scaling == yarn; config.json "rope_scaling" type "yarn").
struct rope_yarn_params {
    float ext_factor = 1.0f;  ///< weight of the extrapolation ramp, in [0, 1] (llama.cpp yarn_ext_factor)
    float beta_fast = 32.0f;  ///< rotations where the ramp starts (pure extrapolation above)
    float beta_slow = 1.0f;   ///< rotations where it ends (pure interpolation below); < beta_fast
    friend bool operator==(const rope_yarn_params&, const rope_yarn_params&) = default;
};

/// Llama 3.1+ frequency factors (rope.scaling == llama3; config.json "rope_type": "llama3").
struct rope_llama3_params {
    float factor = 8.0f;            ///< divisor of the low frequencies (>= 1)
    float low_freq_factor = 1.0f;   ///< wavelengths above n_ctx_orig / low_freq_factor get `factor`
    float high_freq_factor = 4.0f;  ///< wavelengths below n_ctx_orig / high_freq_factor keep 1 (> low)
    friend bool operator==(const rope_llama3_params&, const rope_llama3_params&) = default;
};

/// M-RoPE extra position components of one token (Qwen2-VL / Qwen2.5-VL; llama.cpp's
/// per-cell "ext" positions): height, width and llama.cpp's fourth "extra" component. The
/// temporal component is the token's ordinary position. Text tokens of Qwen2-VL use
/// h = w = the position, e = 0; image tokens their patch row / column offsets.
struct mrope_pos {
    pos_t h = 0;  ///< height position (section 1)
    pos_t w = 0;  ///< width position (section 2)
    pos_t e = 0;  ///< extra position (section 3; 0 for text models)
    friend bool operator==(const mrope_pos&, const mrope_pos&) = default;
};

/// M-RoPE sections (llama.cpp rope_sections / HF mrope_section, in pairs): pair i's angle
/// uses component c(i) of the token's positions (0 = temporal, 1 = height, 2 = width,
/// 3 = extra), all with the pair's usual frequency w_i. With S = the sum of the sections and
/// k = i mod S: contiguous (Qwen2-VL "mrope"): c = 0 for k < s0, 1 below s0 + s1, 2 below
/// s0 + s1 + s2, else 3; interleaved (Qwen3-VL "imrope"): c = 1 if k mod 3 = 1 and k < 3 s1,
/// 2 if k mod 3 = 2 and k < 3 s2, 0 if k mod 3 = 0 and k < 3 s0, else 3.
/// All four sections 0 (the default) means M-RoPE is off.
struct rope_mrope_params {
    std::array<std::uint32_t, 4> sections{};  ///< pairs per component t, h, w, e
    bool interleaved = false;                 ///< Qwen3-VL interleaved layout ("imrope")

    [[nodiscard]] std::uint64_t total() const noexcept {
        return std::uint64_t{sections[0]} + sections[1] + sections[2] + sections[3];
    }
    /// Whether M-RoPE is on (some section nonzero).
    [[nodiscard]] bool on() const noexcept { return total() != 0; }
    /// Which position component (0 t, 1 h, 2 w, 3 e) drives pair i. Call only when on().
    [[nodiscard]] std::uint32_t component(std::uint32_t pair) const noexcept {
        const auto k = static_cast<std::uint64_t>(pair) % total();
        if (interleaved) {
            if (k % 3 == 1 && k < 3ull * sections[1]) return 1;
            if (k % 3 == 2 && k < 3ull * sections[2]) return 2;
            if (k % 3 == 0 && k < 3ull * sections[0]) return 0;
            return 3;
        }
        if (k < sections[0]) return 0;
        if (k < std::uint64_t{sections[0]} + sections[1]) return 1;
        if (k < std::uint64_t{sections[0]} + sections[1] + sections[2]) return 2;
        return 3;
    }
    friend bool operator==(const rope_mrope_params&, const rope_mrope_params&) = default;
};

/// RoPE parameters. Pair i of n = n_rot rotated dimensions turns by theta_i(p) = p * w_i with
///   b     = freq_base * ntk_alpha^(n / (n - 2))         (NTK-aware base scaling; b = freq_base if n <= 2)
///   e_i   = b^(-2i / n) / f_i                           (f_i: freq_factors, llama3 or LongRoPE table, else 1)
///   w_i   = freq_scale * e_i                            (linear scaling / interpolation)
///   YaRN: w_i = freq_scale * e_i * (1 - m_i) + e_i * m_i, m_i = ext_factor * ramp_i, ramp_i = 1 below
///         pair lo, 0 above pair hi, linear between (lo / hi from beta_fast / beta_slow and n_ctx_orig,
///         as llama.cpp's ggml_rope_yarn_corr_dims).
/// rope_rows also scales the rotated pairs by attn_factor (YaRN / LongRoPE mscale); the K-shift
/// never does (a shift composes rotations: R(d) R(p) = R(p + d), the magnitude is already in K).
/// LongRoPE picks its table per position: long_factors from p >= n_ctx_orig on, so a K-shift
/// is exact only between positions on the same side; moves across are refused.
/// M-RoPE (mrope.on()): pair i's angle is p_c * w_i with p_c the component mrope.component(i)
/// of the token's positions (t = the position, then the cell's mrope_pos h, w, e). The
/// K-shift, seq_add and seq_div move the temporal component only: the pairs of the other
/// sections keep their angle (llama.cpp refuses such shifts instead).
/// Fields of a scaling not selected are ignored (and left out of state fingerprints).
struct rope_params {
    rope_type type = rope_type::normal;
    float freq_base = 10000.0f;
    float freq_scale = 1.0f;  ///< linear scaling: 1 / factor ("linear"; YaRN's interpolation)
    std::uint32_t n_rot = 0;  ///< rotated dimensions per head (even); 0 means head_dim_k
    float ntk_alpha = 1.0f;   ///< NTK-aware base scaling (1 = off)
    float attn_factor = 1.0f; ///< magnitude applied by rope_rows to q and k (HF attention_factor / mscale)
    rope_scaling scaling = rope_scaling::none;
    std::uint32_t n_ctx_orig = 0;  ///< original context (original_max_position_embeddings): YaRN, llama3, LongRoPE
    rope_yarn_params yarn{};       ///< scaling == yarn
    rope_llama3_params llama3{};   ///< scaling == llama3
    rope_factors freq_factors{};   ///< none / yarn: optional per-pair divisors (llama.cpp rope_freqs)
    rope_factors short_factors{};  ///< longrope: divisors for positions below n_ctx_orig
    rope_factors long_factors{};   ///< longrope: divisors for positions from n_ctx_orig on
    rope_mrope_params mrope{};     ///< M-RoPE sections (off by default)

    /// Field by field (float fields compared exactly; tables by value).
    friend bool operator==(const rope_params&, const rope_params&) = default;

    /// YaRN's default magnitude for a context extension `factor` (= 1 / freq_scale):
    /// 0.1 ln(factor) + 1, or 1 when factor <= 1 (HF get_mscale).
    [[nodiscard]] static float yarn_mscale(float factor) noexcept {
        return factor <= 1.0f ? 1.0f : static_cast<float>(0.1 * std::log(static_cast<double>(factor)) + 1.0);
    }
    /// LongRoPE's default magnitude: sqrt(1 + ln(s) / ln(n_ctx_orig)), s = max_position_embeddings
    /// / n_ctx_orig, or 1 when s <= 1 (HF Phi-3).
    [[nodiscard]] static float longrope_mscale(double max_pos, double n_ctx_orig) noexcept {
        const double s = max_pos / n_ctx_orig;
        return s <= 1.0 ? 1.0f : static_cast<float>(std::sqrt(1.0 + std::log(s) / std::log(n_ctx_orig)));
    }
    /// Whether a LongRoPE key at position p uses long_factors (always false for other scalings).
    [[nodiscard]] bool uses_long_factors(std::int64_t p) const noexcept {
        return scaling == rope_scaling::longrope && p >= static_cast<std::int64_t>(n_ctx_orig);
    }
    /// Whether a K rotated at position `from` turns into the K at `to` by the rotation of
    /// to - from alone (false only for LongRoPE moves across n_ctx_orig).
    [[nodiscard]] bool shift_exact(std::int64_t from, std::int64_t to) const noexcept {
        return uses_long_factors(from) == uses_long_factors(to);
    }
    /// Whether anything beyond type, freq_base, freq_scale and n_rot is in use.
    [[nodiscard]] bool extended() const noexcept {
        return ntk_alpha != 1.0f || attn_factor != 1.0f || scaling != rope_scaling::none || !freq_factors.empty() ||
               mrope.on();
    }

    /// Throws kvcache::error(code) naming `prefix` + the first bad field and its value;
    /// head_dim is the K dimension the parameters rotate.
    void validate(std::uint32_t head_dim, errc code = errc::invalid_config, const std::string& prefix = "rope.") const {
        using std::to_string;
        auto bad = [&](const std::string& name, const std::string& value, const std::string& why) {
            detail::fail(code, prefix + name + " = " + value + ": " + why);
        };
        auto positive = [&](const char* name, float v) {
            if (!(std::isfinite(v) && v > 0.0f)) bad(name, std::to_string(v), "must be finite and > 0");
        };
        if (n_rot > head_dim) bad("n_rot", to_string(n_rot), "must not exceed head_dim_k = " + to_string(head_dim));
        const std::uint32_t n = n_rot == 0 ? head_dim : n_rot;
        if (n % 2 != 0) bad("n_rot", to_string(n), "must be even (RoPE rotates pairs)");
        positive("freq_base", freq_base);
        positive("freq_scale", freq_scale);
        if (type != rope_type::normal && type != rope_type::neox)
            bad("type", to_string(static_cast<int>(type)), "must be normal or neox");
        positive("ntk_alpha", ntk_alpha);
        positive("attn_factor", attn_factor);
        auto table = [&](const char* name, const rope_factors& t, bool allowed) {
            if (t.empty()) return;
            if (!allowed)
                bad(name, "a table of " + to_string(t.size()),
                    "only for scaling longrope, this one's scaling is " + to_string(static_cast<int>(scaling)));
            if (t.size() != n / 2)
                bad(name, "a table of " + to_string(t.size()), "must hold n_rot / 2 = " + to_string(n / 2) + " factors");
            for (std::size_t i = 0; i < t.size(); ++i)
                if (!(std::isfinite(t[i]) && t[i] > 0.0f))
                    bad(std::string(name) + "[" + to_string(i) + "]", std::to_string(t[i]), "must be finite and > 0");
        };
        auto need_ctx = [&]() {
            if (n_ctx_orig == 0) bad("n_ctx_orig", "0", "must be >= 1 for this scaling (original_max_position_embeddings)");
        };
        switch (scaling) {
            case rope_scaling::none:
                table("freq_factors", freq_factors, true);
                break;
            case rope_scaling::yarn:
                table("freq_factors", freq_factors, true);
                need_ctx();
                if (!(std::isfinite(yarn.ext_factor) && yarn.ext_factor >= 0.0f && yarn.ext_factor <= 1.0f))
                    bad("yarn.ext_factor", std::to_string(yarn.ext_factor), "must be in [0, 1]");
                positive("yarn.beta_fast", yarn.beta_fast);
                positive("yarn.beta_slow", yarn.beta_slow);
                if (!(yarn.beta_fast > yarn.beta_slow))
                    bad("yarn.beta_fast", std::to_string(yarn.beta_fast),
                        "must be > yarn.beta_slow = " + std::to_string(yarn.beta_slow));
                break;
            case rope_scaling::llama3:
                if (!freq_factors.empty())
                    bad("freq_factors", "a table of " + to_string(freq_factors.size()),
                        "must be empty with scaling llama3 (the factors come from rope.llama3)");
                need_ctx();
                if (!(std::isfinite(llama3.factor) && llama3.factor >= 1.0f))
                    bad("llama3.factor", std::to_string(llama3.factor), "must be finite and >= 1");
                positive("llama3.low_freq_factor", llama3.low_freq_factor);
                positive("llama3.high_freq_factor", llama3.high_freq_factor);
                if (!(llama3.high_freq_factor > llama3.low_freq_factor))
                    bad("llama3.high_freq_factor", std::to_string(llama3.high_freq_factor),
                        "must be > llama3.low_freq_factor = " + std::to_string(llama3.low_freq_factor));
                break;
            case rope_scaling::longrope:
                if (!freq_factors.empty())
                    bad("freq_factors", "a table of " + to_string(freq_factors.size()),
                        "must be empty with scaling longrope (use short_factors / long_factors)");
                need_ctx();
                if (short_factors.empty()) bad("short_factors", "empty", "must hold n_rot / 2 = " + to_string(n / 2) + " factors");
                if (long_factors.empty()) bad("long_factors", "empty", "must hold n_rot / 2 = " + to_string(n / 2) + " factors");
                break;
            default:
                bad("scaling", to_string(static_cast<int>(scaling)), "must be none, yarn, llama3 or longrope");
        }
        const bool lr = scaling == rope_scaling::longrope;
        table("short_factors", short_factors, lr);
        table("long_factors", long_factors, lr);
        if (mrope.on()) {
            if (mrope.total() > n / 2)
                bad("mrope.sections", std::to_string(mrope.total()) + " pairs in all",
                    "must not exceed n_rot / 2 = " + to_string(n / 2));
            if (lr)
                bad("mrope.sections", std::to_string(mrope.total()) + " pairs in all",
                    "M-RoPE with scaling longrope is not supported (which position picks the table?)");
        }
    }
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
        rope.validate(head_dim_k, errc::invalid_config, "model_shape.rope.");
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
