// Package trace reads request traces in Mooncake's format (one JSON object a line:
// timestamp ms, input_length, output_length, hash_ids of 512-token prefix blocks) and rebuilds
// sessions from the hash ids: a request continues the session of the earlier request with which
// it shares the longest run of leading hash ids (at least MinSharedBlocks). Broken lines and
// impossible lengths are counted, reported and skipped, never fatal.
package trace
