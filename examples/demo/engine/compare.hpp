// demo engine: comparing numbers where NaN must never look like agreement. std::max(x, NaN)
// returns x and every comparison with NaN is false, so a plain "max |difference|" over NaN
// logits reads 0 and an argmax skips them. Every check of the demo goes through these.
#pragma once

#include <cmath>    // std::isnan, std::isfinite, std::abs
#include <cstddef>  // std::size_t
#include <limits>   // quiet_NaN

namespace demo {

/// max(acc, x), except that NaN wins and stays: once either is NaN the result is NaN.
[[nodiscard]] inline double nan_max(double acc, double x) noexcept {
    if (std::isnan(acc) || std::isnan(x)) return std::numeric_limits<double>::quiet_NaN();
    return x > acc ? x : acc;
}

/// Result of compare_logits.
struct logits_comparison {
    double max_abs_diff = 0;  ///< max |got - want|; NaN when either side holds a non-finite value
    bool argmax_same = true;  ///< same index of the largest logit (false when anything is non-finite)
    bool finite = true;       ///< every value on both sides is finite

    /// Agreement within tol: finite, max |diff| <= tol and the same argmax. NaN never passes.
    [[nodiscard]] bool ok(double tol) const noexcept { return finite && argmax_same && max_abs_diff <= tol; }
};

/// Compares n logits (n >= 1). A NaN or infinity on either side is a mismatch: a real model's
/// logits are finite, and a non-finite value means a broken weight, kernel or cache.
[[nodiscard]] inline logits_comparison compare_logits(const float* got, const float* want, std::size_t n) noexcept {
    logits_comparison r;
    std::size_t best_got = 0, best_want = 0;
    for (std::size_t i = 0; i < n; ++i) {
        if (!std::isfinite(got[i]) || !std::isfinite(want[i])) r.finite = false;
        r.max_abs_diff = nan_max(r.max_abs_diff, std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i])));
        if (got[i] > got[best_got]) best_got = i;
        if (want[i] > want[best_want]) best_want = i;
    }
    if (!r.finite) {
        r.max_abs_diff = std::numeric_limits<double>::quiet_NaN();
        r.argmax_same = false;
    } else {
        r.argmax_same = best_got == best_want;
    }
    return r;
}

}  // namespace demo
