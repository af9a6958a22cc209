// Standard normal floats for filling caches with random K/V in tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>

namespace kvtest {

/// Standard normal floats from a std::mt19937, by Box-Muller in double, used like
/// std::normal_distribution<float>(0, 1): `normal_floats nd; x = nd(rng);`.
/// std::normal_distribution draws its uniforms through std::generate_canonical, which in
/// libstdc++ takes a long-double logarithm per draw: filling a ~12K-cell cache that way
/// was about 40% of a kernel test's run time under the sanitizers.
class normal_floats {
public:
    float operator()(std::mt19937& rng) {
        if (has_spare_) {
            has_spare_ = false;
            return spare_;
        }
        constexpr double two32 = 4294967296.0;
        const double u1 = (static_cast<double>(rng()) + 1.0) / two32;  // (0, 1]: log(u1) is finite
        const double u2 = static_cast<double>(rng()) / two32;          // [0, 1)
        const double r = std::sqrt(-2.0 * std::log(u1));
        const double t = 2.0 * std::numbers::pi * u2;
        spare_ = static_cast<float>(r * std::sin(t));
        has_spare_ = true;
        return static_cast<float>(r * std::cos(t));
    }

private:
    float spare_ = 0.0f;
    bool has_spare_ = false;
};

}  // namespace kvtest
