// A seeded mutation loop around fuzz_untrusted_input.cpp's entry point, for compilers without
// libFuzzer (and for ctest: deterministic from its seed). It reads the seed files of the directories
// given, runs each, then mutates them for --seconds: bytes flipped or set to JSON's structural
// characters, ranges deleted or repeated, numbers swapped for hostile ones (1e999, 2^64, -1, 2^62),
// splices of two seeds. Whatever the target does not accept or refuse by name aborts it.
//   fuzz_untrusted_input_loop [--seconds N] [--seed S] DIR...
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "synthetic/random.h"

extern "C" int LLVMFuzzerInitialize(int*, char***);
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

using Bytes = std::vector<std::uint8_t>;

constexpr const char* kTokens[] = {"1e999",
                                   "-1e999",
                                   "18446744073709551616",
                                   "9223372036854775807",
                                   "4611686018427387904",
                                   "2147483648",
                                   "-1",
                                   "0",
                                   "1.5",
                                   "null",
                                   "true",
                                   "[]",
                                   "{}",
                                   "\"\"",
                                   "\"dtype\"",
                                   "\"shape\"",
                                   "\"data_offsets\"",
                                   "\"weight_map\"",
                                   "\"hidden_size\"",
                                   "\"num_experts\"",
                                   "\"__metadata__\"",
                                   "\"F8_E4M3\"",
                                   "\"BF16\"",
                                   "[[[[[[[[",
                                   "\"\\u0000\""};

void mutate(Bytes& b, const std::vector<Bytes>& seeds, moekit::synthetic::SplitMix& rng) {
  const std::uint64_t edits = 1 + rng.next() % 4;
  for (std::uint64_t k = 0; k < edits; ++k) {
    // The first byte picks the parser: mutate after it.
    const std::size_t n = b.size() > 1 ? b.size() - 1 : 1;
    const std::size_t at = 1 + static_cast<std::size_t>(rng.next() % n);
    switch (rng.next() % 7) {
      case 0:  // a byte anywhere
        if (at < b.size()) b[at] = static_cast<std::uint8_t>(rng.next());
        break;
      case 1: {  // a structural character
        const char kChars[] = "{}[]\",:0123456789-e.E \\";
        if (at < b.size()) b[at] = static_cast<std::uint8_t>(kChars[rng.next() % (sizeof(kChars) - 1)]);
        break;
      }
      case 2:  // a range deleted
        if (at < b.size())
          b.erase(b.begin() + static_cast<std::ptrdiff_t>(at),
                  b.begin() + static_cast<std::ptrdiff_t>(std::min(b.size(), at + rng.next() % 16)));
        break;
      case 3: {  // a range repeated (a key twice, an entry twice)
        if (at >= b.size()) break;
        const std::size_t len = std::min<std::size_t>(b.size() - at, 1 + rng.next() % 64);
        const Bytes piece(b.begin() + static_cast<std::ptrdiff_t>(at),
                          b.begin() + static_cast<std::ptrdiff_t>(at + len));
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), piece.begin(), piece.end());
        break;
      }
      case 4: {  // a hostile token inserted
        const std::string t = kTokens[rng.next() % std::size(kTokens)];
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(std::min(at, b.size())), t.begin(), t.end());
        break;
      }
      case 5: {  // a number swapped for a hostile one
        std::size_t i = at;
        while (i < b.size() && !(b[i] >= '0' && b[i] <= '9')) ++i;
        std::size_t j = i;
        while (j < b.size() && ((b[j] >= '0' && b[j] <= '9') || b[j] == '.' || b[j] == 'e' || b[j] == '-')) ++j;
        if (i >= b.size()) break;
        const std::string t = kTokens[rng.next() % 8];
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(i), b.begin() + static_cast<std::ptrdiff_t>(j));
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(i), t.begin(), t.end());
        break;
      }
      default: {  // a splice: this input's head, another seed's tail
        const Bytes& o = seeds[rng.next() % seeds.size()];
        if (o.size() < 2 || at >= b.size()) break;
        const std::size_t from = 1 + static_cast<std::size_t>(rng.next() % (o.size() - 1));
        b.resize(at);
        b.insert(b.end(), o.begin() + static_cast<std::ptrdiff_t>(from), o.end());
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 10;
  std::uint64_t seed = 1;
  std::vector<Bytes> seeds;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seconds" && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      for (const auto& f : std::filesystem::recursive_directory_iterator(a)) {
        if (!f.is_regular_file()) continue;
        std::ifstream in(f.path(), std::ios::binary);
        seeds.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      }
    }
  }
  if (seeds.empty()) {
    std::fprintf(stderr, "usage: %s [--seconds N] [--seed S] SEED_DIR...\n", argv[0]);
    return 2;
  }
  LLVMFuzzerInitialize(&argc, &argv);
  for (const Bytes& s : seeds) LLVMFuzzerTestOneInput(s.data(), s.size());
  moekit::synthetic::SplitMix rng{seed};
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  long runs = 0;
  while (std::chrono::steady_clock::now() < end) {
    for (int k = 0; k < 64; ++k, ++runs) {
      Bytes b = seeds[rng.next() % seeds.size()];
      mutate(b, seeds, rng);
      LLVMFuzzerTestOneInput(b.data(), b.size());
    }
  }
  std::printf("fuzz: seeded mutation loop, seed %llu, %.0f s, %zu seeds\n", static_cast<unsigned long long>(seed),
              seconds, seeds.size());
  return 0;
}
