// kvcache: the set of sequence ids that use a cell (a fixed-size bitset).
#pragma once

#include <array>    // words
#include <bit>      // std::popcount, std::countr_zero
#include <cstdint>  // std::uint64_t

#include "../config.hpp"
#include "../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Bitset of sequence ids in [0, KVCACHE_MAX_SEQ). Callers validate ids first.
class seq_set {
public:
    static constexpr int capacity = KVCACHE_MAX_SEQ;

    constexpr seq_set() = default;
    static constexpr seq_set of(seq_id_t s) noexcept {
        seq_set r;
        r.set(s);
        return r;
    }

    constexpr bool test(seq_id_t s) const noexcept { return (w_[idx(s)] >> bit(s)) & 1u; }
    constexpr void set(seq_id_t s) noexcept { w_[idx(s)] |= std::uint64_t{1} << bit(s); }
    constexpr void reset(seq_id_t s) noexcept { w_[idx(s)] &= ~(std::uint64_t{1} << bit(s)); }
    constexpr void clear() noexcept { w_ = {}; }
    constexpr bool none() const noexcept {
        for (auto w : w_)
            if (w) return false;
        return true;
    }
    constexpr bool any() const noexcept { return !none(); }
    constexpr int count() const noexcept {
        int c = 0;
        for (auto w : w_) c += std::popcount(w);
        return c;
    }
    /// Calls f(seq_id) for every member in increasing order.
    template <class F>
    constexpr void for_each(F&& f) const {
        for (std::size_t i = 0; i < words; ++i)
            for (std::uint64_t w = w_[i]; w != 0; w &= w - 1)
                f(static_cast<seq_id_t>(i * 64 + static_cast<std::size_t>(std::countr_zero(w))));
    }
    friend constexpr bool operator==(const seq_set&, const seq_set&) = default;

private:
    static constexpr std::size_t words = KVCACHE_MAX_SEQ / 64;
    // Ids are validated by the callers; the modulo keeps an invalid id in bounds anyway.
    static constexpr std::size_t idx(seq_id_t s) noexcept {
        return (static_cast<std::uint32_t>(s) % static_cast<std::uint32_t>(capacity)) / 64;
    }
    static constexpr unsigned bit(seq_id_t s) noexcept { return static_cast<std::uint32_t>(s) % 64; }
    std::array<std::uint64_t, words> w_{};
};

KVCACHE_END_NAMESPACE
