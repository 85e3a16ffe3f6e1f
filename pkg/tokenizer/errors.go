package tokenizer

import (
	"errors"
	"fmt"
)

// Error classes of Load and ApplyChatTemplate; test with errors.Is.
var (
	// ErrNotFound: the tokenizer path (or a file in it) does not exist or cannot be read.
	ErrNotFound = errors.New("tokenizer: file not found")
	// ErrCorrupt: a file exists but is not valid JSON or lacks what a tokenizer.json must hold.
	ErrCorrupt = errors.New("tokenizer: corrupt file")
	// ErrUnsupported: a valid tokenizer.json that uses a model type, normalizer, pre-tokenizer
	// or regex this package does not implement exactly.
	ErrUnsupported = errors.New("tokenizer: unsupported")
	// ErrNoChatTemplate: ApplyChatTemplate on a tokenizer without a chat template.
	ErrNoChatTemplate = errors.New("tokenizer: no chat template")
	// ErrTemplate: the chat template failed to compile or to render.
	ErrTemplate = errors.New("tokenizer: chat template error")
)

// LoadError is what Load returns: the file, the error class (one of the Err* values above)
// and the detail.
type LoadError struct {
	Path   string
	Kind   error
	Detail string
	Err    error
}

func (e *LoadError) Error() string {
	s := fmt.Sprintf("%v: %s", e.Kind, e.Path)
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap exposes both the class and the underlying error to errors.Is / errors.As.
func (e *LoadError) Unwrap() []error {
	if e.Err == nil {
		return []error{e.Kind}
	}
	return []error{e.Kind, e.Err}
}

func unsupported(path, format string, args ...any) error {
	return &LoadError{Path: path, Kind: ErrUnsupported, Detail: fmt.Sprintf(format, args...)}
}

func corrupt(path string, err error, format string, args ...any) error {
	return &LoadError{Path: path, Kind: ErrCorrupt, Detail: fmt.Sprintf(format, args...), Err: err}
}
