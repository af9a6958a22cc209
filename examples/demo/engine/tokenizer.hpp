// demo engine: a byte-level tokenizer.
//
// Ids follow the Llama/SentencePiece byte-fallback convention: 0 = <unk>, 1 = <s> (BOS),
// 2 = </s> (EOS), and byte b is token 3 + b. With a vocabulary smaller than 259 the
// bytes wrap modulo the text range. Good enough to drive a random model or a real
// llama2.c checkpoint with readable (if not fluent) text.
#pragma once

#include <cstdint>      // std::int32_t
#include <stdexcept>    // std::invalid_argument
#include <string>       // text
#include <string_view>  // input
#include <vector>       // token lists

#include <kvcache/prompt/token.hpp>

namespace demo {

using token_t = kvcache::token_t;

class byte_tokenizer {
public:
    static constexpr token_t bos = 1;
    static constexpr token_t eos = 2;
    static constexpr token_t first_byte = 3;

    /// vocab_size >= 4 (three specials and at least one text token).
    explicit byte_tokenizer(int vocab_size) : n_text_(vocab_size - first_byte) {
        if (vocab_size < 4)
            throw std::invalid_argument("byte_tokenizer: vocab_size = " + std::to_string(vocab_size) +
                                        ", must be >= 4");
    }

    /// Text to tokens; with add_bos the list starts with <s>.
    [[nodiscard]] std::vector<token_t> encode(std::string_view text, bool add_bos) const {
        std::vector<token_t> out;
        out.reserve(text.size() + 1);
        if (add_bos) out.push_back(bos);
        for (unsigned char c : text) out.push_back(first_byte + static_cast<token_t>(c % n_text_));
        return out;
    }
    /// Tokens to text: text tokens become bytes, specials and ids outside the byte range are dropped.
    [[nodiscard]] std::string decode(const std::vector<token_t>& tokens) const {
        std::string s;
        for (token_t t : tokens) s += piece(t);
        return s;
    }
    /// One token as text ("" for specials and ids outside the byte range).
    [[nodiscard]] std::string piece(token_t t) const {
        if (t < first_byte || t - first_byte >= 256 || t - first_byte >= n_text_) return {};
        return std::string(1, static_cast<char>(t - first_byte));
    }

private:
    int n_text_;  // text tokens: ids [3, 3 + n_text_)
};

}  // namespace demo
