// demo engine: endless generation past the context size (context shift, F13) and
// Self-Extend grouped attention (F14), both as sequence operations on a kv_cache.
#pragma once

#include <cstdint>    // fixed-width integers
#include <string>     // messages
#include <stdexcept>  // std::invalid_argument

#include <kvcache/kvcache.hpp>

namespace demo {

using kvcache::pos_t;
using kvcache::seq_id_t;

/// What a context shift removes: positions [n_keep, n_keep + n_discard) go, the rest
/// of [n_keep + n_discard, n_past) moves left by n_discard.
struct context_shift_plan {
    pos_t n_keep = 0;
    pos_t n_discard = 0;
    pos_t n_past_after = 0;
};

/// F13: validates and plans a context shift. n_discard < 0 means the default (n_past - n_keep) / 2.
/// Requires 0 <= n_keep <= n_past and 0 < n_discard <= n_past - n_keep; anything else throws
/// std::invalid_argument naming the value (a negative n_discard was a heap overflow in llama.cpp,
/// CVE-2026-21869).
inline context_shift_plan plan_context_shift(pos_t n_past, pos_t n_keep, pos_t n_discard = -1) {
    if (n_past < 0) throw std::invalid_argument("context shift: n_past = " + std::to_string(n_past) + ", must be >= 0");
    if (n_keep < 0 || n_keep > n_past)
        throw std::invalid_argument("context shift: n_keep = " + std::to_string(n_keep) + ", must be in [0, n_past = " +
                                    std::to_string(n_past) + "]");
    if (n_discard < 0) n_discard = (n_past - n_keep) / 2;
    if (n_discard <= 0 || n_discard > n_past - n_keep)
        throw std::invalid_argument("context shift: n_discard = " + std::to_string(n_discard) +
                                    ", must be in [1, n_past - n_keep = " + std::to_string(n_past - n_keep) + "]");
    return {n_keep, n_discard, n_past - n_discard};
}

/// Applies a context shift to sequence seq of the cache (seq_rm + seq_add; the K-shift
/// stays pending until the next eval or kvcache::ops::apply_k_shift). Returns the new n_past.
template <class Cache>
pos_t context_shift(Cache& cache, seq_id_t seq, pos_t n_past, const context_shift_plan& plan) {
    cache.seq_rm(seq, plan.n_keep, plan.n_keep + plan.n_discard);
    cache.seq_add(seq, plan.n_keep + plan.n_discard, n_past, -plan.n_discard);
    return plan.n_past_after;
}

/// Self-Extend (F14): positions beyond the window are compressed by ga_n, exactly as
/// llama.cpp's main loop does it (ib, bd, dd below). Call apply() before each batch.
///
/// After apply(), a token that was appended at "uncompressed" position p sits at
///   p / ga_n                  if p < ga_n * ga_i()
///   p - (ga_n - 1) * ga_i()   otherwise,
/// and n_past = tokens so far - (ga_n - 1) * ga_i() (the tests check this formula).
class self_extend {
public:
    /// ga_n >= 1 (group factor), ga_w > 0 (window), ga_w a multiple of ga_n.
    self_extend(int ga_n, int ga_w) : ga_n_(ga_n), ga_w_(ga_w) {
        if (ga_n < 1) throw std::invalid_argument("self_extend: ga_n = " + std::to_string(ga_n) + ", must be >= 1");
        if (ga_w <= 0) throw std::invalid_argument("self_extend: ga_w = " + std::to_string(ga_w) + ", must be > 0");
        if (ga_w % ga_n != 0)
            throw std::invalid_argument("self_extend: ga_w = " + std::to_string(ga_w) +
                                        " must be a multiple of ga_n = " + std::to_string(ga_n));
    }

    [[nodiscard]] int ga_n() const noexcept { return ga_n_; }
    [[nodiscard]] int ga_w() const noexcept { return ga_w_; }
    /// Start of the part of the sequence not compressed yet (grows by ga_w / ga_n per step).
    [[nodiscard]] pos_t ga_i() const noexcept { return ga_i_; }

    /// Compresses sequence seq while n_past >= ga_i + ga_w; returns the new n_past.
    template <class Cache>
    pos_t apply(Cache& cache, seq_id_t seq, pos_t n_past) {
        if (ga_n_ == 1) return n_past;
        while (n_past >= ga_i_ + ga_w_) {
            const int ib = (ga_n_ * ga_i_) / ga_w_;
            const int bd = (ga_w_ / ga_n_) * (ga_n_ - 1);
            const int dd = (ga_w_ / ga_n_) - ib * bd - ga_w_;
            cache.seq_add(seq, ga_i_, n_past, ib * bd);
            cache.seq_div(seq, ga_i_ + ib * bd, ga_i_ + ib * bd + ga_w_, ga_n_);
            cache.seq_add(seq, ga_i_ + ib * bd + ga_w_, n_past + ib * bd, dd);
            n_past -= bd;
            ga_i_ += ga_w_ / ga_n_;
        }
        return n_past;
    }

    /// The position the formula above gives to the token appended at uncompressed position p.
    [[nodiscard]] pos_t expected_pos(pos_t p) const noexcept {
        return p < ga_n_ * ga_i_ ? p / ga_n_ : p - (ga_n_ - 1) * ga_i_;
    }

private:
    int ga_n_;
    int ga_w_;
    pos_t ga_i_ = 0;  // positions [0, ga_i_) are already grouped
};

}  // namespace demo
