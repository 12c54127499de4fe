// Unicode Normalization Form C (canonical decomposition, canonical ordering, canonical
// composition), as Hugging Face tokenizers apply it before splitting text into words.
#pragma once

#include <string>
#include <string_view>

namespace iris {

// NFC of well-formed UTF-8 text; throws iris::Error naming the byte offset of ill-formed input.
std::string nfc_normalize(std::string_view utf8_text);

// True when the text is certainly already in NFC (the UAX #15 quick check answers "yes"), so that
// normalizing can be skipped. False means "maybe not": nfc_normalize decides.
bool nfc_quick_check(std::string_view utf8_text);

// The Unicode version of the tables (that of the Python which generated them).
const char* nfc_unicode_version();

}  // namespace iris
