package pagehash_test

import (
	"fmt"

	"github.com/kvcentric/kvcentric/pkg/pagehash"
)

// The control plane's two questions: is the resident KV a prefix of the new prompt, and if
// not, how many pages can be kept.
func Example() {
	h, _ := pagehash.New(4, 0)
	resident := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}         // 3 pages on D
	appended := append(append([]uint32{}, resident...), 13, 14, 15, 16) // the next turn
	edited := []uint32{1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12, 13, 14}   // history edited in page 2

	session, _ := pagehash.NewSparse(pagehash.DefaultTail, pagehash.DefaultStride)
	session.Append(h.Chain(resident))

	fmt.Println(session.IsPrefixOf(h.Chain(appended)), session.CommonPages(h.Chain(appended)))
	fmt.Println(session.IsPrefixOf(h.Chain(edited)), session.CommonPages(h.Chain(edited)))
	// Output:
	// true 3
	// false 1
}
