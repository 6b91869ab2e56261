"""The JSON Schema corpus of the structured-output benchmarks and tests, written for this repo.

SCHEMAS holds (name, schema) pairs of the kinds agents and structured-output libraries send: tool
arguments, extraction, classification, a chain of thought, and the keywords they lean on (nested
objects, enums, bounded arrays, anyOf/oneOf, $ref/$defs with a recursive comment tree, formats,
patterns, numeric bounds, const, nullable fields, `additionalProperties: false` as OpenAI's
strict mode requires). Each is small: few required fields, strings bounded where natural, arrays
of at most 3 items, so a 135M-parameter model fills one in about 120 tokens (greedy decoding of
SmolLM2-135M-Instruct under each grammar finished all of them, in 3 to 97 tokens, each answer
valid against its schema). PROMPTS gives each a user prompt asking for that JSON.

UNSUPPORTED holds (name, schema, expected) triples that the engine must refuse: `expected` is a
lowercase substring of its error message. Invalid JSON Schema is caught by jsonschema's
check_schema ("not a valid json schema"); the rest is valid JSON Schema that llguidance 1.9.1
does not compile, with a substring of llguidance's own message (found by compiling each one).

Longer than 700 lines because it is data, not logic: one literal schema after another, kept in
one module so a reader sees the whole corpus and the names stay unique in one place.
"""

from __future__ import annotations

import copy

_STR40 = {"type": "string", "maxLength": 40}
_STR60 = {"type": "string", "maxLength": 60}
# Formats with an unbounded tail (an email's local part, a time's fraction of a second) get a
# maxLength too: a small model left free runs on to max_tokens.
_EMAIL = {"type": "string", "format": "email", "maxLength": 40}
_TIME = {"type": "string", "format": "time", "maxLength": 20}
# Two decimals at most: a bare number lets a small model write 0.99999... to max_tokens.
_CONFIDENCE = {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}

# (name, prompt, schema), grouped by kind.
_TOOL_ARGUMENTS: list[tuple[str, str, dict]] = [
    (
        "weather_lookup",
        "Give the weather lookup arguments for Paris in celsius.",
        {
            "type": "object",
            "properties": {
                "city": _STR40,
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    ),
    (
        "web_search",
        "Give the search tool arguments to find recent news about electric cars, 5 results.",
        {
            "type": "object",
            "properties": {
                "query": _STR60,
                "num_results": {"type": "integer", "minimum": 1, "maximum": 10},
                "recency": {"type": "string", "enum": ["day", "week", "month", "any"]},
            },
            "required": ["query", "num_results"],
            "additionalProperties": False,
        },
    ),
    (
        "calendar_event",
        "Create a calendar event: team lunch on 2024-06-14 at 12:30 for 60 minutes.",
        {
            "type": "object",
            "properties": {
                "title": _STR40,
                "date": {"type": "string", "format": "date"},
                "start_time": _TIME,
                "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                "attendees": {
                    "type": "array",
                    "items": _EMAIL,
                    "maxItems": 3,
                },
            },
            "required": ["title", "date", "start_time"],
            "additionalProperties": False,
        },
    ),
    (
        "sql_query_params",
        "Give the query parameters to list the name and email of 20 customers.",
        {
            "type": "object",
            "properties": {
                "table": {"type": "string", "enum": ["orders", "customers", "products"]},
                "columns": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^[a-z_]{1,20}$"},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "where": {"type": ["string", "null"], "maxLength": 60},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            },
            "required": ["table", "columns", "where", "limit"],
            "additionalProperties": False,
        },
    ),
    (
        "file_edit",
        "Give the file edit that renames the variable count to total in src/app.py.",
        {
            "type": "object",
            "properties": {
                "path": {"type": "string", "pattern": "^[A-Za-z0-9_./-]{1,60}$"},
                "old_text": _STR60,
                "new_text": _STR60,
            },
            "required": ["path", "old_text", "new_text"],
            "additionalProperties": False,
        },
    ),
    (
        "send_email",
        "Give the arguments to email bob@example.com that the report is ready.",
        {
            "type": "object",
            "properties": {
                "to": _EMAIL,
                "subject": _STR40,
                "body": _STR60,
                "cc": {
                    "type": "array",
                    "items": _EMAIL,
                    "maxItems": 2,
                },
            },
            "required": ["to", "subject", "body"],
        },
    ),
    (
        "set_timer",
        "Set a timer for 25 minutes labelled 'tea'. Give the tool arguments.",
        {
            "type": "object",
            "properties": {
                "minutes": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1440},
                "label": {"type": "string", "maxLength": 30},
            },
            "required": ["minutes"],
            "additionalProperties": False,
        },
    ),
    (
        "stock_quote",
        "Give the arguments to look up Apple's stock price on NASDAQ.",
        {
            "type": "object",
            "properties": {
                "ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
                "exchange": {"type": "string", "enum": ["NYSE", "NASDAQ", "LSE"]},
            },
            "required": ["ticker", "exchange"],
            "additionalProperties": False,
        },
    ),
    (
        "unit_conversion",
        "Give the arguments to convert 12 miles to kilometers.",
        {
            "type": "object",
            "properties": {
                "value": {"type": "number"},
                "from_unit": {"type": "string", "enum": ["km", "mi", "m", "ft", "kg", "lb"]},
                "to_unit": {"type": "string", "enum": ["km", "mi", "m", "ft", "kg", "lb"]},
            },
            "required": ["value", "from_unit", "to_unit"],
            "additionalProperties": False,
        },
    ),
    (
        "http_request",
        "Give the arguments for a GET request to https://api.example.com/users.",
        {
            "type": "object",
            "properties": {
                "method": {"type": "string", "enum": ["GET", "POST", "PUT", "DELETE"]},
                "url": {"type": "string", "format": "uri"},
                "headers": {
                    "type": "object",
                    "additionalProperties": {"type": "string", "maxLength": 40},
                    "maxProperties": 2,
                },
            },
            "required": ["method", "url"],
        },
    ),
    (
        "translate_text",
        "Give the arguments to translate 'good morning' from English to Spanish.",
        {
            "type": "object",
            "properties": {
                "text": _STR60,
                "source_lang": {"type": "string", "pattern": "^[a-z]{2}$"},
                "target_lang": {"type": "string", "pattern": "^[a-z]{2}$"},
            },
            "required": ["text", "source_lang", "target_lang"],
            "additionalProperties": False,
        },
    ),
    (
        "book_flight",
        "Book a flight from JFK to LHR on 2024-09-01 for 2 passengers in economy.",
        {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "departure_date": {"type": "string", "format": "date"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "cabin": {"type": "string", "enum": ["economy", "premium", "business", "first"]},
            },
            "required": ["origin", "destination", "departure_date", "passengers", "cabin"],
            "additionalProperties": False,
        },
    ),
    (
        "run_shell_command",
        "Give the arguments to list the files in /tmp with a 10 second timeout.",
        {
            "type": "object",
            "properties": {
                "command": _STR60,
                "timeout_seconds": {"type": "integer", "minimum": 1, "maximum": 600},
                "cwd": {"type": ["string", "null"], "maxLength": 40},
            },
            "required": ["command", "timeout_seconds", "cwd"],
            "additionalProperties": False,
        },
    ),
    (
        "create_issue",
        "File an issue: the login page crashes on submit. Label it a bug, priority 1.",
        {
            "type": "object",
            "properties": {
                "title": _STR60,
                "labels": {
                    "type": "array",
                    "items": {"type": "string", "enum": ["bug", "feature", "docs", "question"]},
                    "maxItems": 3,
                },
                "priority": {"type": "integer", "minimum": 1, "maximum": 4},
            },
            "required": ["title", "labels", "priority"],
            "additionalProperties": False,
        },
    ),
    (
        "restaurant_reservation",
        "Reserve a table for 4 at Luigi's on 2024-05-20 at 19:00.",
        {
            "type": "object",
            "properties": {
                "restaurant": _STR40,
                "party_size": {"type": "integer", "minimum": 1, "maximum": 12},
                "date": {"type": "string", "format": "date"},
                "time": _TIME,
            },
            "required": ["restaurant", "party_size", "date", "time"],
            "additionalProperties": False,
        },
    ),
    (
        "order_lookup",
        "Give the arguments to look up an order by its id, and whether to include its items.",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "format": "uuid"},
                "include_items": {"type": "boolean"},
            },
            "required": ["order_id", "include_items"],
            "additionalProperties": False,
        },
    ),
    (
        "calculator",
        "Give the calculator tool arguments to compute 17 times 23 plus 4.",
        {
            "type": "object",
            "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/(). -]{1,40}$"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    ),
]

_EXTRACTION: list[tuple[str, str, dict]] = [
    (
        "invoice",
        "Extract the invoice: INV-0042 from Acme Corp dated 2024-03-01, 2 widgets at 60 USD.",
        {
            "type": "object",
            "properties": {
                "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                "issue_date": {"type": "string", "format": "date"},
                "vendor": _STR40,
                "total": {"type": "number", "minimum": 0},
                "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                "line_items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "description": _STR40,
                            "quantity": {"type": "integer", "minimum": 1},
                            "unit_price": {"type": "number", "minimum": 0},
                        },
                        "required": ["description", "quantity", "unit_price"],
                        "additionalProperties": False,
                    },
                    "maxItems": 2,
                },
            },
            "required": ["invoice_number", "vendor", "total", "currency"],
            "additionalProperties": False,
        },
    ),
    (
        "person",
        "Extract the person: Maria Lopez, 34, maria@example.com, no phone given.",
        {
            "type": "object",
            "properties": {
                "name": _STR40,
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": _EMAIL,
                "phone": {
                    "anyOf": [
                        {"type": "string", "pattern": "^\\+?[0-9 -]{7,15}$"},
                        {"type": "null"},
                    ]
                },
            },
            "required": ["name", "age", "email", "phone"],
            "additionalProperties": False,
        },
    ),
    (
        "address",
        "Extract the address: 221B Baker Street, London NW1 6XE, United Kingdom.",
        {
            "type": "object",
            "properties": {
                "street": _STR60,
                "city": _STR40,
                "postal_code": {"type": "string", "pattern": "^[0-9A-Z -]{3,10}$"},
                "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
            },
            "required": ["street", "city", "postal_code", "country_code"],
            "additionalProperties": False,
        },
    ),
    (
        "product_review",
        "Summarise this review as JSON: 'Great headphones, comfy and loud. 4 stars.'",
        {
            "type": "object",
            "properties": {
                "product": _STR40,
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "sentiment": {"type": "string", "enum": ["positive", "mixed", "negative"]},
                "pros": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 30},
                    "maxItems": 3,
                },
                "would_recommend": {"type": "boolean"},
            },
            "required": ["product", "rating", "sentiment", "would_recommend"],
            "additionalProperties": False,
        },
    ),
    (
        "contact_card",
        "Make a contact card for Sam Lee, sam@example.org, living at 5 Main St, Springfield.",
        {
            "$defs": {
                "Address": {
                    "title": "Address",
                    "type": "object",
                    "properties": {
                        "street": {"title": "Street", "type": "string", "maxLength": 60},
                        "city": {"title": "City", "type": "string", "maxLength": 40},
                    },
                    "required": ["street", "city"],
                },
            },
            "title": "ContactCard",
            "type": "object",
            "properties": {
                "name": {"title": "Name", "type": "string", "maxLength": 40},
                "email": {"title": "Email", "type": "string", "format": "email", "maxLength": 40},
                "address": {"$ref": "#/$defs/Address"},
            },
            "required": ["name", "email", "address"],
        },
    ),
    (
        "meeting_action_items",
        "List the action items: Ana sends the slides by 2024-04-02; Raj books the room.",
        {
            "type": "object",
            "properties": {
                "action_items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "owner": {"type": "string", "maxLength": 30},
                            "task": _STR40,
                            "due": {"type": ["string", "null"], "format": "date"},
                        },
                        "required": ["owner", "task", "due"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["action_items"],
            "additionalProperties": False,
        },
    ),
    (
        "job_posting",
        "Extract the job: remote senior Python engineer at Initech, full time, 120k-150k.",
        {
            "type": "object",
            "properties": {
                "title": _STR40,
                "company": _STR40,
                "remote": {"type": "boolean"},
                "employment_type": {
                    "type": "string",
                    "enum": ["full_time", "part_time", "contract"],
                },
                "salary_min": {"type": "integer", "minimum": 0, "maximum": 10000000},
                "salary_max": {"type": "integer", "minimum": 0, "maximum": 10000000},
            },
            "required": ["title", "company", "remote", "employment_type"],
            "additionalProperties": False,
        },
    ),
    (
        "recipe",
        "Give a short vegetarian pancake recipe for 2 servings as JSON.",
        {
            "type": "object",
            "properties": {
                "name": _STR40,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "vegetarian": {"type": "boolean"},
                "ingredients": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "item": {"type": "string", "maxLength": 20},
                            "amount": {"type": "string", "maxLength": 20},
                        },
                        "required": ["item", "amount"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["name", "servings", "vegetarian", "ingredients"],
            "additionalProperties": False,
        },
    ),
    (
        "movie",
        "Describe the movie The Matrix (1999) as JSON with its genres and a rating out of 10.",
        {
            "type": "object",
            "properties": {
                "title": _STR40,
                "year": {"type": "integer", "minimum": 1888, "maximum": 2030},
                "genres": {
                    "type": "array",
                    "items": {
                        "type": "string",
                        "enum": ["action", "comedy", "drama", "sci-fi", "horror"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
                "rating": {"type": "number", "minimum": 0, "maximum": 10},
            },
            "required": ["title", "year", "genres", "rating"],
            "additionalProperties": False,
        },
    ),
    (
        "receipt",
        "Extract the receipt: Corner Cafe, 2024-02-11, total 8.50, paid by card.",
        {
            "type": "object",
            "properties": {
                "store": _STR40,
                "date": {"type": "string", "format": "date"},
                "total": {"type": "number", "minimum": 0},
                "payment_method": {"type": "string", "enum": ["cash", "card", "mobile"]},
            },
            "required": ["store", "date", "total", "payment_method"],
            "additionalProperties": False,
        },
    ),
    (
        "event_mention",
        "Extract the event: the product launch at Moscone Center starts 2024-10-03T09:00:00Z.",
        {
            "type": "object",
            "properties": {
                "event_name": _STR40,
                "starts_at": {"type": "string", "format": "date-time"},
                "venue": {"type": ["string", "null"], "maxLength": 40},
            },
            "required": ["event_name", "starts_at", "venue"],
            "additionalProperties": False,
        },
    ),
    (
        "book",
        "Give the book Dune by Frank Herbert as JSON with its ISBN-13 and year.",
        {
            "type": "object",
            "properties": {
                "title": _STR40,
                "author": _STR40,
                "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
                "published_year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            },
            "required": ["title", "author", "published_year"],
            "additionalProperties": False,
        },
    ),
    (
        "company_profile",
        "Describe the company Globex: founded 1989, 1200 employees, based in Oslo, Norway.",
        {
            "$defs": {
                "Location": {
                    "type": "object",
                    "properties": {"city": _STR40, "country": _STR40},
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {
                "name": _STR40,
                "founded": {"type": "integer", "minimum": 1800, "maximum": 2030},
                "employees": {"type": "integer", "minimum": 1},
                "headquarters": {"$ref": "#/$defs/Location"},
            },
            "required": ["name", "founded", "headquarters"],
            "additionalProperties": False,
        },
    ),
    (
        "log_entry",
        "Turn this log line into JSON: 2024-01-05T10:00:00Z ERROR disk full on /var.",
        {
            "type": "object",
            "properties": {
                "timestamp": {"type": "string", "format": "date-time"},
                "level": {"type": "string", "enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
                "message": _STR60,
                "request_id": {"type": "string", "format": "uuid"},
            },
            "required": ["timestamp", "level", "message"],
            "additionalProperties": False,
        },
    ),
    (
        "bookmark",
        "Save a bookmark for https://docs.python.org titled Python docs, tagged python.",
        {
            "type": "object",
            "properties": {
                "url": {"type": "string", "format": "uri"},
                "title": _STR40,
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^[a-z0-9-]{1,20}$"},
                    "maxItems": 3,
                },
            },
            "required": ["url", "title"],
            "additionalProperties": False,
        },
    ),
]

_CLASSIFICATION_AND_REASONING: list[tuple[str, str, dict]] = [
    (
        "sentiment_classification",
        "Classify the sentiment of: 'The delivery was late and the box was crushed.'",
        {
            "type": "object",
            "properties": {
                "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                "confidence": _CONFIDENCE,
            },
            "required": ["label", "confidence"],
            "additionalProperties": False,
        },
    ),
    (
        "intent_classification",
        "Classify the intent of: 'I want to cancel my subscription.'",
        {
            "type": "object",
            "properties": {
                "intent": {
                    "type": "string",
                    "enum": ["billing", "cancel", "upgrade", "support", "other"],
                },
                "confidence": _CONFIDENCE,
            },
            "required": ["intent", "confidence"],
            "additionalProperties": False,
        },
    ),
    (
        "topic_tags",
        "Tag this headline with up to 3 topics: 'Central bank raises rates as tech stocks fall.'",
        {
            "type": "object",
            "properties": {
                "topics": {
                    "type": "array",
                    "items": {
                        "type": "string",
                        "enum": ["finance", "tech", "politics", "sports", "health"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["topics"],
            "additionalProperties": False,
        },
    ),
    (
        "spam_detection",
        "Is this message spam? 'You won a free cruise, click here now!'",
        {
            "type": "object",
            "properties": {"is_spam": {"type": "boolean"}, "reason": _STR60},
            "required": ["is_spam", "reason"],
            "additionalProperties": False,
        },
    ),
    (
        "moderation",
        "Moderate this comment: 'I will find you and hurt you.'",
        {
            "type": "object",
            "properties": {
                "flagged": {"type": "boolean"},
                "categories": {
                    "type": "object",
                    "properties": {
                        "hate": {"type": "boolean"},
                        "violence": {"type": "boolean"},
                        "self_harm": {"type": "boolean"},
                    },
                    "required": ["hate", "violence", "self_harm"],
                    "additionalProperties": False,
                },
            },
            "required": ["flagged", "categories"],
            "additionalProperties": False,
        },
    ),
    (
        "language_detection",
        "Which language is this, as an ISO 639-1 code? 'Wo ist der Bahnhof?'",
        {
            "type": "object",
            "properties": {
                "language": {"type": "string", "pattern": "^[a-z]{2}$"},
                "confidence": _CONFIDENCE,
            },
            "required": ["language", "confidence"],
            "additionalProperties": False,
        },
    ),
    (
        "ticket_triage",
        "Triage this ticket: 'Production database is down, all customers affected.'",
        {
            "type": "object",
            "properties": {
                "category": {"type": "string", "enum": ["bug", "outage", "billing", "how_to"]},
                "priority": {"type": "string", "enum": ["low", "medium", "high", "urgent"]},
                "needs_human": {"type": "boolean"},
            },
            "required": ["category", "priority", "needs_human"],
            "additionalProperties": False,
        },
    ),
    (
        "chain_of_thought",
        "A train travels 60 km in 1.5 hours. What is its speed? Reason, then answer.",
        {
            "type": "object",
            "properties": {
                "reasoning": {"type": "string", "maxLength": 150},
                "answer": _STR40,
            },
            "required": ["reasoning", "answer"],
            "additionalProperties": False,
        },
    ),
    (
        "math_steps",
        "Solve 3x + 5 = 20 in at most 3 short steps and give x.",
        {
            "type": "object",
            "properties": {
                "steps": {"type": "array", "items": _STR40, "minItems": 1, "maxItems": 3},
                "final_answer": {"type": "number"},
            },
            "required": ["steps", "final_answer"],
            "additionalProperties": False,
        },
    ),
    (
        "yes_no_answer",
        "Is the Pacific the largest ocean? Answer yes or no with a short reason.",
        {
            "type": "object",
            "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "reason": _STR60},
            "required": ["answer", "reason"],
            "additionalProperties": False,
        },
    ),
    (
        "multiple_choice",
        "Which planet is largest? A) Mars B) Jupiter C) Venus D) Earth. Pick one and explain.",
        {
            "type": "object",
            "properties": {
                "choice": {"type": "string", "enum": ["A", "B", "C", "D"]},
                "explanation": _STR60,
            },
            "required": ["choice", "explanation"],
            "additionalProperties": False,
        },
    ),
]

_COMMENT_LEAF = {
    "type": "object",
    "properties": {
        "author": {"type": "string", "maxLength": 12},
        "text": {"type": "string", "maxLength": 30},
    },
    "required": ["author", "text"],
    "additionalProperties": False,
}

_STRUCTURE: list[tuple[str, str, dict]] = [
    (
        "payment_method_oneof",
        "The customer paid by card ending 4242. Give the payment method as JSON.",
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "card"},
                        "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
                    },
                    "required": ["kind", "last4"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "bank_transfer"},
                        "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9A-Z]{10,30}$"},
                    },
                    "required": ["kind", "iban"],
                    "additionalProperties": False,
                },
            ],
        },
    ),
    (
        "shape_anyof",
        "Describe a circle of radius 3 as a shape.",
        {
            "type": "object",
            "properties": {
                "shape": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "circle"},
                                "radius": {"type": "number", "exclusiveMinimum": 0},
                            },
                            "required": ["type", "radius"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "rectangle"},
                                "width": {"type": "number", "exclusiveMinimum": 0},
                                "height": {"type": "number", "exclusiveMinimum": 0},
                            },
                            "required": ["type", "width", "height"],
                            "additionalProperties": False,
                        },
                    ],
                },
            },
            "required": ["shape"],
            "additionalProperties": False,
        },
    ),
    (
        "contact_method_anyof",
        "How can we reach Dana? Her email is dana@example.com. Give the contact as JSON.",
        {
            "type": "object",
            "properties": {
                "contact": {
                    "anyOf": [
                        _EMAIL,
                        {"type": "string", "pattern": "^\\+[0-9]{7,14}$"},
                    ],
                },
                "preferred_hours": {"type": "string", "enum": ["morning", "afternoon", "evening"]},
            },
            "required": ["contact"],
            "additionalProperties": False,
        },
    ),
    (
        "record_id_oneof",
        "Give the record reference for record 1042 in the users collection.",
        {
            "type": "object",
            "properties": {
                "collection": {"type": "string", "maxLength": 20},
                "id": {
                    "oneOf": [
                        {"type": "integer", "minimum": 0},
                        {"type": "string", "maxLength": 20},
                    ]
                },
            },
            "required": ["collection", "id"],
            "additionalProperties": False,
        },
    ),
    (
        "pet_discriminated_union",
        "Alex owns a cat named Tom that meows 3 times a day. Give the owner record.",
        {
            "$defs": {
                "Cat": {
                    "title": "Cat",
                    "type": "object",
                    "properties": {
                        "pet_type": {"title": "Pet Type", "type": "string", "const": "cat"},
                        "name": {"title": "Name", "type": "string", "maxLength": 20},
                        "meows_per_day": {
                            "title": "Meows Per Day",
                            "type": "integer",
                            "minimum": 0,
                        },
                    },
                    "required": ["pet_type", "name", "meows_per_day"],
                    "additionalProperties": False,
                },
                "Dog": {
                    "title": "Dog",
                    "type": "object",
                    "properties": {
                        "pet_type": {"title": "Pet Type", "type": "string", "const": "dog"},
                        "name": {"title": "Name", "type": "string", "maxLength": 20},
                        "good_boy": {"title": "Good Boy", "type": "boolean"},
                    },
                    "required": ["pet_type", "name", "good_boy"],
                    "additionalProperties": False,
                },
            },
            "title": "Owner",
            "type": "object",
            "properties": {
                "owner": {"title": "Owner", "type": "string", "maxLength": 30},
                "pet": {
                    "title": "Pet",
                    "discriminator": {
                        "propertyName": "pet_type",
                        "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"},
                    },
                    "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                },
            },
            "required": ["owner", "pet"],
            "additionalProperties": False,
        },
    ),
    (
        "pydantic_user_profile",
        "Make a user profile for jdoe, age 41, with no address on file.",
        {
            "$defs": {
                "Address": {
                    "title": "Address",
                    "type": "object",
                    "properties": {
                        "city": {"title": "City", "type": "string", "maxLength": 40},
                        "zip": {"title": "Zip", "type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                },
                "Role": {"title": "Role", "type": "string", "enum": ["admin", "member", "guest"]},
            },
            "title": "UserProfile",
            "description": "A user of the service.",
            "type": "object",
            "properties": {
                "username": {"title": "Username", "type": "string", "pattern": "^[a-z0-9_]{3,16}$"},
                "age": {
                    "anyOf": [{"type": "integer", "minimum": 13, "maximum": 120}, {"type": "null"}],
                    "default": None,
                    "title": "Age",
                },
                "role": {"$ref": "#/$defs/Role", "default": "member"},
                "address": {
                    "anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}],
                    "default": None,
                },
            },
            "required": ["username"],
        },
    ),
    (
        "todo_strict_nullable",
        "Add a todo: renew passport, no due date yet, not done.",
        {
            "type": "object",
            "properties": {
                "task": _STR40,
                "due_date": {"type": ["string", "null"], "format": "date"},
                "done": {"type": "boolean"},
            },
            "required": ["task", "due_date", "done"],
            "additionalProperties": False,
        },
    ),
    (
        "allof_extended_item",
        "Describe a catalogue item: a blue mug, sku MUG-001, price 9.99.",
        {
            "allOf": [
                {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
                    "required": ["sku"],
                },
                {
                    "type": "object",
                    "properties": {"name": _STR40, "price": {"type": "number", "minimum": 0}},
                    "required": ["name", "price"],
                },
            ],
        },
    ),
    (
        "api_envelope_const",
        "Wrap a success result with message 'saved' in the v1 API envelope.",
        {
            "type": "object",
            "properties": {
                "api_version": {"const": "v1"},
                "ok": {"const": True},
                "message": _STR40,
            },
            "required": ["api_version", "ok", "message"],
            "additionalProperties": False,
        },
    ),
    (
        "comment_tree_recursive",
        (
            "Thread: ann wrote 'nice post', bob replied 'thanks'. Give it as nested JSON where "
            "each comment has author, text and replies (an empty list when none)."
        ),
        {
            "$defs": {
                "comment": {
                    "type": "object",
                    "properties": {
                        "author": {"type": "string", "maxLength": 20},
                        "text": _STR40,
                        "replies": {
                            "type": "array",
                            "items": {"$ref": "#/$defs/comment"},
                            "maxItems": 2,
                        },
                    },
                    "required": ["author", "text"],
                    "additionalProperties": False,
                },
            },
            "$ref": "#/$defs/comment",
        },
    ),
    (
        "comment_tree_depth_limited",
        (
            "Thread: ann wrote 'nice post', bob replied 'thanks', ann answered bob 'welcome'. "
            "Give it as nested JSON: author, text and replies."
        ),
        {
            "$defs": {
                "leaf": _COMMENT_LEAF,
                "reply": {
                    "type": "object",
                    "properties": {
                        **_COMMENT_LEAF["properties"],
                        "replies": {
                            "type": "array",
                            "items": {"$ref": "#/$defs/leaf"},
                            "maxItems": 1,
                        },
                    },
                    "required": ["author", "text"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {
                **_COMMENT_LEAF["properties"],
                "replies": {"type": "array", "items": {"$ref": "#/$defs/reply"}, "maxItems": 1},
            },
            "required": ["author", "text", "replies"],
            "additionalProperties": False,
        },
    ),
    (
        "filter_tree_recursive",
        "Write a product search filter: price below 20 and colour is red.",
        {
            "$defs": {
                "node": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {
                                "field": {"type": "string", "maxLength": 20},
                                "op": {"type": "string", "enum": ["eq", "lt", "gt"]},
                                "value": {"type": ["string", "number"], "maxLength": 20},
                            },
                            "required": ["field", "op", "value"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "all_of": {
                                    "type": "array",
                                    "items": {"$ref": "#/$defs/node"},
                                    "minItems": 2,
                                    "maxItems": 3,
                                },
                            },
                            "required": ["all_of"],
                            "additionalProperties": False,
                        },
                    ],
                },
            },
            "$ref": "#/$defs/node",
        },
    ),
    (
        "geo_point_tuple",
        "Give the latitude and longitude of Tokyo as a two-element array.",
        {
            "type": "array",
            "prefixItems": [
                {"type": "number", "minimum": -90, "maximum": 90},
                {"type": "number", "minimum": -180, "maximum": 180},
            ],
            "items": False,
            "minItems": 2,
        },
    ),
    (
        "word_counts_map",
        "Count the words in 'the cat saw the dog' for the, cat and dog, as a JSON object.",
        {
            "type": "object",
            "additionalProperties": {"type": "integer", "minimum": 0},
            "maxProperties": 3,
        },
    ),
    (
        "env_vars_pattern_properties",
        "Give two environment variables for a web app, LOG_LEVEL and PORT, as JSON.",
        {
            "type": "object",
            "patternProperties": {"^[A-Z_]{1,20}$": {"type": "string", "maxLength": 40}},
            "additionalProperties": False,
            "maxProperties": 3,
        },
    ),
    (
        "thermostat_bounds",
        "Set the living room thermostat to 21.5 degrees in heat mode.",
        {
            "type": "object",
            "properties": {
                "room": {"type": "string", "maxLength": 20},
                "target_celsius": {"type": "number", "minimum": 10, "maximum": 30},
                "mode": {"type": "string", "enum": ["heat", "cool", "auto", "off"]},
            },
            "required": ["room", "target_celsius", "mode"],
            "additionalProperties": False,
        },
    ),
    (
        "discount_exclusive_bounds",
        "Create a 15 percent discount code SPRING15 valid until 2024-04-30.",
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z0-9]{4,12}$"},
                "percent_off": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
                "expires": {"type": "string", "format": "date"},
            },
            "required": ["code", "percent_off", "expires"],
            "additionalProperties": False,
        },
    ),
    (
        "feature_flags",
        "Give the feature flags: dark mode on, beta search off, new checkout on.",
        {
            "type": "object",
            "properties": {
                "dark_mode": {"type": "boolean"},
                "beta_search": {"type": "boolean"},
                "new_checkout": {"type": "boolean"},
            },
            "required": ["dark_mode", "beta_search", "new_checkout"],
            "additionalProperties": False,
        },
    ),
    (
        "retry_policy_mixed_enum",
        "Give a retry policy: 3 retries with exponential backoff, timeout auto.",
        {
            "type": "object",
            "properties": {
                "retries": {"type": "integer", "enum": [0, 1, 3, 5]},
                "backoff": {"type": "string", "enum": ["none", "linear", "exponential"]},
                "timeout": {"enum": ["auto", 5, 30, None]},
            },
            "required": ["retries", "backoff", "timeout"],
            "additionalProperties": False,
        },
    ),
    (
        "city_list_top_level_array",
        "List three European capital cities as a JSON array of strings.",
        {
            "type": "array",
            "items": {"type": "string", "maxLength": 30},
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    (
        "color_top_level_enum",
        "What colour is a ripe banana? Answer with one JSON string.",
        {"type": "string", "enum": ["red", "green", "blue", "yellow", "black", "white"]},
    ),
    (
        "date_range",
        "Give the date range for the first week of March 2024.",
        {
            "type": "object",
            "properties": {
                "start": {"type": "string", "format": "date"},
                "end": {"type": "string", "format": "date"},
            },
            "required": ["start", "end"],
            "additionalProperties": False,
        },
    ),
    (
        "zod_style_draft7",
        "Give a signup form submission for user kim with newsletter opt-in.",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"Username": {"type": "string", "minLength": 3, "maxLength": 16}},
            "type": "object",
            "properties": {
                "username": {"$ref": "#/definitions/Username"},
                "newsletter": {"type": "boolean"},
            },
            "required": ["username", "newsletter"],
            "additionalProperties": False,
        },
    ),
    (
        "open_answer_object",
        "What is the capital of Canada? Reply with a JSON object holding the answer.",
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {"answer": _STR40},
            "required": ["answer"],
        },
    ),
]

_CORPUS = _TOOL_ARGUMENTS + _EXTRACTION + _CLASSIFICATION_AND_REASONING + _STRUCTURE

# Deep copies: the literals above share sub-schemas (_STR40 ...), and a caller may edit one.
SCHEMAS: list[tuple[str, dict]] = [(name, copy.deepcopy(schema)) for name, _, schema in _CORPUS]
PROMPTS: dict[str, str] = {name: prompt for name, prompt, _ in _CORPUS}

_NOT_VALID = "not a valid json schema"

UNSUPPORTED: list[tuple[str, dict, str]] = [
    # Not valid JSON Schema: check_schema refuses each (llguidance too, except where noted).
    ("misspelled_type", {"type": "strin"}, _NOT_VALID),
    ("properties_not_object", {"type": "object", "properties": 5}, _NOT_VALID),
    ("minimum_not_number", {"type": "integer", "minimum": "ten"}, _NOT_VALID),
    ("required_not_array", {"type": "object", "required": "name"}, _NOT_VALID),
    ("negative_max_length", {"type": "string", "maxLength": -1}, _NOT_VALID),
    ("unparsable_pattern", {"type": "string", "pattern": "(["}, _NOT_VALID),
    # Draft 4's boolean exclusiveMinimum: llguidance compiles it, check_schema (2020-12) does not.
    (
        "draft4_boolean_exclusive_minimum",
        {"type": "number", "minimum": 0, "exclusiveMinimum": True},
        _NOT_VALID,
    ),
    # Valid JSON Schema that llguidance 1.9.1 does not compile; its message in `expected`.
    (
        "unknown_format",
        {"type": "string", "format": "credit-card-number"},
        "unknown format: credit-card-number",
    ),
    (
        "format_uri_reference",
        {"type": "string", "format": "uri-reference"},
        "unknown format: uri-reference",
    ),
    (
        "if_then_else",
        {
            "type": "object",
            "properties": {"country": {"type": "string"}, "postal_code": {"type": "string"}},
            "if": {"properties": {"country": {"const": "US"}}},
            "then": {"required": ["postal_code"]},
            "else": {},
        },
        'unimplemented keys: ["else", "if", "then"]',
    ),
    (
        "dependent_schemas",
        {
            "type": "object",
            "properties": {"card": {"type": "string"}, "billing_zip": {"type": "string"}},
            "dependentSchemas": {"card": {"required": ["billing_zip"]}},
        },
        'unimplemented keys: ["dependentschemas"]',
    ),
    (
        "dependent_required",
        {
            "type": "object",
            "properties": {"card": {"type": "string"}, "billing_zip": {"type": "string"}},
            "dependentRequired": {"card": ["billing_zip"]},
        },
        'unimplemented keys: ["dependentrequired"]',
    ),
    (
        "draft7_dependencies",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"card": {"type": "string"}, "billing_zip": {"type": "string"}},
            "dependencies": {"card": ["billing_zip"]},
        },
        'unimplemented keys: ["dependencies"]',
    ),
    (
        "contains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}, "maxItems": 3},
        'unimplemented keys: ["contains"]',
    ),
    # Refused even as `uniqueItems: false`; pydantic writes `uniqueItems: true` for a set field.
    (
        "unique_items",
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 3},
        'unimplemented keys: ["uniqueitems"]',
    ),
    (
        "not",
        {"type": "object", "properties": {"name": {"type": "string", "not": {"const": "admin"}}}},
        'unimplemented keys: ["not"]',
    ),
    (
        "property_names",
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "maxProperties": 3},
        'unimplemented keys: ["propertynames"]',
    ),
    (
        "unevaluated_properties",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "unevaluatedProperties": False,
        },
        'unimplemented keys: ["unevaluatedproperties"]',
    ),
    (
        "unevaluated_items",
        {"type": "array", "prefixItems": [{"type": "string"}], "unevaluatedItems": False},
        'unimplemented keys: ["unevaluateditems"]',
    ),
    # oneOf whose branches may overlap (an empty object matches both). llguidance compiles a
    # oneOf only where it sees the branches are disjoint: inline objects with distinct required
    # consts, or $ref branches with a `discriminator` (pydantic's), not $ref branches without one.
    (
        "overlapping_one_of",
        {
            "oneOf": [
                {"type": "object", "properties": {"a": {"type": "string"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}},
            ],
        },
        "oneof constraints are not supported",
    ),
    ("dangling_ref", {"$ref": "#/$defs/Missing"}, "does not exist"),
    (
        "unsatisfiable_bounds",
        {"type": "integer", "minimum": 5, "maximum": 1},
        "unsatisfiable schema",
    ),
    ("lookahead_pattern", {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{8}$"}, "look-around"),
]
