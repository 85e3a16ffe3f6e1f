package tokenizer_test

import (
	"errors"
	"fmt"

	"github.com/kvcentric/kvcentric/pkg/tokenizer"
)

// A bad tokenizer path is a start-up error with a class the caller can test.
func ExampleLoad() {
	_, err := tokenizer.Load("/nonexistent/model")
	fmt.Println(errors.Is(err, tokenizer.ErrNotFound))
	var le *tokenizer.LoadError
	fmt.Println(errors.As(err, &le), le.Path)
	// Output:
	// true
	// true /nonexistent/model
}
