// demo engine: picking the next token from logits (greedy or temperature sampling).
#pragma once

#include <cmath>      // std::exp
#include <cstdint>    // std::uint64_t
#include <stdexcept>  // std::invalid_argument
#include <string>     // messages
#include <vector>     // probabilities

#include "model.hpp"
#include "tokenizer.hpp"

namespace demo {

/// Index of the largest logit (the first one on ties). logits must be non-empty.
inline token_t argmax(const float* logits, std::size_t n) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < n; ++i)
        if (logits[i] > logits[best]) best = i;
    return static_cast<token_t>(best);
}

/// Greedy (temperature 0) or temperature sampling with a fixed seed.
class sampler {
public:
    /// temperature >= 0 (0: greedy). Throws std::invalid_argument otherwise.
    sampler(float temperature, std::uint64_t seed) : temp_(temperature), rng_(seed) {
        if (!(temperature >= 0.0f))
            throw std::invalid_argument("sampler: temperature = " + std::to_string(temperature) + ", must be >= 0");
    }

    [[nodiscard]] token_t sample(const std::vector<float>& logits) {
        if (logits.empty()) throw std::invalid_argument("sampler: no logits");
        const token_t best = argmax(logits.data(), logits.size());
        if (temp_ == 0.0f) return best;
        // softmax(logits / T) with the maximum subtracted, then inverse-CDF sampling.
        probs_.resize(logits.size());
        double sum = 0;
        const double top = logits[static_cast<std::size_t>(best)];
        for (std::size_t i = 0; i < logits.size(); ++i) sum += probs_[i] = std::exp((logits[i] - top) / temp_);
        double u = rng_.uniform() * sum;
        for (std::size_t i = 0; i < probs_.size(); ++i) {
            u -= probs_[i];
            if (u <= 0) return static_cast<token_t>(i);
        }
        return best;
    }

private:
    float temp_;
    splitmix64 rng_;
    std::vector<double> probs_;
};

}  // namespace demo
