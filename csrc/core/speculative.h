// The speculative loop's state of one token stream (TokenStream::Spec; the loop: speculative.cpp).
#pragma once
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "core/engine.h"

namespace lily {

struct TokenStream::Spec {
  // k = 0: a plain stream drawn in the extension (plain steps only).
  Spec(const StreamOptions& opt, int32_t first)
      : k(opt.speculative), adaptive(opt.adaptive && opt.speculative > 0), plain(opt.speculative == 0),
        pending(first), stats{0, 0, 0, 0, opt.speculative > 0 ? "speculative k=" + std::to_string(opt.speculative)
                                                               : std::string("plain")} {}
  void fall_back(const std::string& why) {
    plain = true;
    stats.status = "plain: " + why;
  }

  int32_t k;                   // drafts per verify
  bool adaptive;               // fall back to plain steps when drafting does not pay
  bool plain;                  // plain steps from here on (k = 0, or fell back)
  int64_t probe = 0;           // adaptive: plain steps still to time before the first verify
  int32_t pending;             // the last token drawn (returned or queued), not yet fed
  std::deque<int32_t> queue;   // drawn, not yet returned by next()
  std::string error;           // non-finite logits met: next() throws it once the queue is returned
  SpecStats stats;

  // The rewind point: the state before the last verify (position snap_position; -1: none held), and the tokens
  // fed since, [t, d_1 .. d_a]. close() feeds back only those the host took (the state never holds a token the
  // host was not given).
  int64_t snap_position = -1;
  int64_t snap_mtp_rows = 0;
  std::vector<Buffer> snap_ssm, snap_conv;
  Buffer snap_hidden;
  std::vector<int32_t> fed;
  int64_t step_tokens = 0;     // tokens the last step queued (the accepted drafts, and its draw unless it failed)

  // The step being run: its rows, [pending] (a plain row of Engine::decode_rows) or [t, d_1 .. d_k] (a verify);
  // a verify's draw that ended its accepted run (-1: none, a row was non-finite) and its drafting's seconds.
  std::vector<int32_t> rows;
  int32_t drawn = -1;
  double draft_s = 0;

  std::vector<float> draft_logits, step_logits;  // [k, V], [V]
};

}  // namespace lily
