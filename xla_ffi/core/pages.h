// Output pages. XLA:CPU hands collectives freshly allocated output buffers, and first-touching them
// (a page fault and a zeroed page each) costs more than the copy itself at large sizes. Two remedies,
// applied by each rank to its own output before it arrives at the rendezvous:
//  - ask for transparent huge pages (one fault per 2 MiB instead of per 4 KiB);
//  - fault the pages in from the owning device thread. The links write an output from all device
//    threads (shm: each rank its slice of every output); faults of many threads interleaved on one
//    buffer contend on its page-table locks, while each thread faulting its own buffer does not, and
//    it does so while it would otherwise wait for slower ranks.
#pragma once

#include <cstddef>

namespace flexlink {

// `aliases_input`: the output is the (donated) input, so its pages are known to be present.
// Only hints and harmless writes into the output's own bytes: contents before the collective writes
// them are unspecified anyway; errors are ignored.
void PrepareOutput(void* out, size_t bytes, bool aliases_input);

}  // namespace flexlink
